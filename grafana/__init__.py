"""The Grafana dashboards as code (`dashboards`, laid out from `panels`) and the PromQL they are
built from (`promql`)."""

{{- /* Generated from service/specserve/config/schema.py by `make generate` (helm/generate.py); do not edit. */}}
{{- define "specserve.notEngineArgs" -}}
capture drafter_weights max_ongoing_requests max_queued_requests max_surge_percent replicas weight
{{- end }}
{{- define "specserve.hubIdPattern" -}}
^[A-Za-z0-9_][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$
{{- end }}

"""EAGLE-3 / EAGLE-3.1 drafters: model, data, training, export, evaluation."""

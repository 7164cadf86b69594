"""The output-layer benchmark: ``python -m app.bench --help``."""

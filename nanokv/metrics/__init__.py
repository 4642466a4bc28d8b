"""Serving metrics: plain stats (stats.py) and the one Prometheus exporter (prometheus.py)."""

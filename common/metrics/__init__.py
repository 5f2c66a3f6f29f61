"""Metrics, in one place: what a role writes (``writer.py``: JSONL records, histograms, time splits, its memory),
how readers read them back (``records.py``), where else they go (``sinks.py``: TensorBoard and W&B;
``prometheus.py``: a role's ``/metrics``), and the intervals the reported numbers carry (``stats.py``)."""

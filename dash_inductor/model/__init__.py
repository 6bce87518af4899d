"""The DASH schedule models: critical paths of the dQ orders (``schedule.py``) and of the
packed deals (``packed_schedule.py``), for the benchmarks and the docs."""

"""The compile-time rewrite: the pre-grad pass (``rewrite.py``), the joint-graph pass
(``rewrite_fused.py``), what each site did and why (``sites.py``), and attention no SDPA call
reaches (``unmatched.py``)."""

"""The ops: ``dash::attention`` and its kin (``op.py``, ``varlen.py``), the public entry
(``entry.py``), validation and layouts (``shapes.py``, ``window.py``, ``packing.py``), the plans kept
per call signature (``signatures.py``), dropout's RNG state and mask (``dropout.py``), and the
PyTorch reference (``reference.py``, ``reference_varlen.py``)."""

"""Gluon kernels for Hopper (sm90): warp-specialized, TMA-fed, with a dedicated dQ writer.

Imported only where Triton has Gluon; the launcher in ``ops/dispatch.py`` picks this family on
sm90 for the inputs ``supports`` accepts and the portable ``tl`` kernels everywhere else.
"""

"""What the portable and Hopper kernels share: the schedule formulas, tickets, tiles, the
backward's preprocess, dQ pass and conversion, launch helpers and the offsets' contract."""

"""The portable kernels (`tl`, every GPU Triton supports and its interpreter) and their launchers."""

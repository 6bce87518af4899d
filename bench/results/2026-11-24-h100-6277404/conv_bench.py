"""convert_dq against torch's copy, three layouts, 16k rows x 2048 dims (d128 and d64)."""
import torch, triton
from dash_inductor.ops.dq_convert import convert_dq
for D in (128, 64):
    H = 2048 // D
    for layout in ("bhle", "blhe", "packed"):
        B, L = (4, 4096) if layout != "packed" else (1, 16384)
        acc = torch.randn(B * H, L, D, device="cuda")
        new = dict(device="cuda", dtype=torch.bfloat16)
        dq = {"bhle": lambda: torch.empty(B, H, L, D, **new), "blhe": lambda: torch.empty(B, L, H, D, **new).transpose(1, 2),
              "packed": lambda: torch.empty(L, H, D, **new).transpose(0, 1).unsqueeze(0)}[layout]()
        view = acc.view(B, H, L, D)
        t_copy = triton.testing.do_bench(lambda: dq.copy_(view), warmup=25, rep=200)
        t_conv = triton.testing.do_bench(lambda: convert_dq(acc, dq), warmup=25, rep=200)
        convert_dq(acc, dq); same = torch.equal(dq, view.to(torch.bfloat16))
        print(f"d{D} {layout:6s} torch copy {t_copy*1e3:.1f} us  convert_dq {t_conv*1e3:.1f} us  equal {same}", flush=True)

"""Section `environment`: versions, the GPU, its memory, the attention backend per dtype, the
device's copy bandwidth."""

from __future__ import annotations

import os

from bench.gpu_check.report import Ctx, timed


def section_environment(ctx: Ctx) -> None:
    import torch
    import transformers

    r = ctx.report
    r.check("env.torch", torch.__version__, "-", "INFO")
    r.check("env.torch_cuda", torch.version.cuda or "none", "-", "INFO")
    r.check("env.transformers", transformers.__version__, "-", "INFO")
    try:
        import triton

        r.check("env.triton", triton.__version__, "-", "INFO")
    except Exception as e:
        r.check("env.triton", f"missing({type(e).__name__})", "-", "INFO")
    r.check("env.cpu_count", os.cpu_count() or 0, "cores", "INFO")
    if ctx.cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        props = torch.cuda.get_device_properties(torch.device(ctx.device))
        r.check("env.gpu", props.name, "-", "INFO")
        r.check("env.gpu_capability", f"{props.major}.{props.minor}", "-", "INFO")
        free, total = torch.cuda.mem_get_info(torch.device(ctx.device))
        r.check("env.gpu_memory_total", total / 2**30, "GiB", "INFO")
        r.check("env.gpu_memory_free", free / 2**30, "GiB", "INFO")
        # float32 exactness assumes IEEE float32 matrix products (torch's default).
        r.check("env.allow_tf32", torch.backends.cuda.matmul.allow_tf32, "-", "INFO")

    def backends() -> None:
        from engine.attention import select_backend
        from engine.kernels.cpu import load_cpu_kernels

        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            kernels = None
            if not ctx.cuda and dtype == torch.float32:
                kernels = load_cpu_kernels()
            backend = select_backend(ctx.device, None, kernels, dtype)
            name = str(dtype).removeprefix("torch.")
            r.check(f"env.attention_backend.{name}", backend.name, "-", "INFO")
            r.check(f"env.attention_block_size.{name}", backend.block_size, "tokens", "INFO")

    ctx.step("env.attention_backend", backends)

    def bandwidth() -> None:
        nbytes = (64 if ctx.small or not ctx.cuda else 2048) * 2**20
        src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
        dst = torch.empty_like(src)
        seconds = timed(ctx, lambda: dst.copy_(src), repeats=10, warmup=3)
        gbs = 2 * nbytes / seconds / 1e9  # read + write
        ctx.report.detail("copy_bytes", nbytes)
        r.check("env.copy_bandwidth", gbs, "GB/s", "INFO")
        BANDWIDTH["GB/s"] = gbs

    ctx.step("env.copy_bandwidth", bandwidth)


BANDWIDTH: dict[str, float] = {}  # measured by `environment`, read by `speed`

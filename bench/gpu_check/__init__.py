"""One prepared run that proves or disproves the CUDA path: `make gpu-check`.

    python3 -m bench.gpu_check [--device cuda|cpu] [--small] [--sections a,b,...] [--out DIR]

Meant for a bare machine with one GPU and only torch, triton, transformers, safetensors, grpcio,
protobuf and prometheus-client installed (no network, no venv, no install step), where there is
time for one run. So the interpreter's and libraries' versions are checked before anything runs
(`versions`), every section has its own deadline (SIGALRM) and catches its own errors
(`CHECK <section>.error <message> - FAIL`), a watchdog thread writes what was measured and exits
should the whole run pass its budget, and nothing is read from disk but this checkout: the
models are written on the spot into a temporary folder.

Sections (see docs/benchmarks.md, "GPU check"), one module each:
  environment  versions, GPU, memory, the attention backend per dtype, device copy bandwidth
  kernels      the Triton attention kernel at Llama-2-13B's head layout (40 heads x 128) and
               with GQA (8 KV heads), fp16 and bf16, decode, prefill and tree rows, against
               torch's SDPA; it compiles the kernel variants the later sections reuse
  exactness    tiny random Llamas (MHA, GQA): greedy `LLM` output against transformers'
               `generate` in float32 and float16, CUDA graphs against eager steps of the same
               runner (any difference beyond a near-tie fails); speculation on against off (a
               random MLP speculator, and scripted drafts of the known greedy continuation;
               tree steps run as graphs) with several prompts whose prefill chunks mix with
               draft trees
  speed        a Llama-2-13B-shaped model with random fp16 weights: batch-1 decode against the
               bandwidth bound (and eagerly, without CUDA graphs), verify steps of 4-32 tree
               rows (16 also eagerly), drafting, batch 8/32/64 decode at contexts 512 and
               2048 judged against the bytes each step moves, a mixed step, peak memory and
               the KV pool
  sharded      NUM_SHARD=2 (two ranks over NCCL, the KV pool sized from device memory) against
               one shard, when two GPUs are visible (INFO otherwise)
  loader       a 4-layer 13B-width checkpoint as sharded safetensors and as .bin: load GB/s and
               host peak memory
  server       the real server (`python -m server.main`) on the device: one Generate and one
               GenerateStream over gRPC (INFO when its gRPC extras or stubs are missing)
  quant        the Triton kernels of quantized weights (GPTQ 4-bit groups of 128, int8 W8A8)
               at a 13B layer's products: error against the exact reference and the
               dequantized fp16 product; 1- and 16-row layer times against fp16 `F.linear` and
               the bytes read

With `--device cpu` the Triton kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported) and the CUDA-graph step runs its static buffers eagerly, so a CPU dry
run reaches both: the `*.triton_launches` and `*.graph_steps` checks count them (and
`quant.kernel_calls` the quantized products).

Each figure is printed as `CHECK <name> <value> <unit> PASS|FAIL|INFO`; everything goes to
`<out>/gpu_check_<device>[_small].json`. The exit code is 1 when any check failed.

This package must not import tests/ or tools.prepare_models (their imports are not on that
machine): the little it needs of them is copied here.
"""

from bench.gpu_check.main import SECTIONS, main

__all__ = ["SECTIONS", "main"]

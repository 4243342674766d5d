#!/usr/bin/env bash
# What needs a GPU, in one run on one device: the tests that are skipped without CUDA (the ring's
# CUDA kernel, remat's CUDA generators and autocast, sharded_call's side streams), then the
# CUDA tables of benchmarks/optim.py and benchmarks/ring_blocks.py (benchmarks/README.md, "On
# GPUs"). Usage: benchmarks/gpu.sh, with pshard and its test requirements importable.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
status=0
python -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name())"
timeout 300 python -m pytest -q -p no:cacheprovider -rs \
    tests/test_ring_kernels.py::test_on_a_cuda_device \
    tests/test_remat.py::test_random_ops_on_cuda \
    tests/test_remat.py::test_offload_on_cuda \
    tests/test_remat.py::test_offload_keeps_what_the_policy_keeps_in_cpu_memory \
    tests/test_remat_modes.py::test_cuda_amp_loop_matches_torch_utils_checkpoint \
    tests/test_sharded_call_policy.py::test_prefetch_on_cuda_streams_changes_no_bit || status=1
timeout 120 python benchmarks/optim.py --device cuda || status=1
timeout 120 python benchmarks/optim.py --device cuda --width 4096 --vocab 128000 || status=1
timeout 150 python benchmarks/ring_blocks.py --device cuda --seq 4096 16384 --ranks 2 4 8 || status=1
timeout 120 python benchmarks/ring_blocks.py --device cuda --seq 16384 --ranks 4 8 --window 2048 \
    || status=1
exit $status

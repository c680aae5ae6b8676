"""Data parallelism on the GPU: two ranks sharing one CUDA device over gloo equal one process.

On the CPU the engine has no streams, so ``test_dp_training`` cannot see the ordering between the d2h
stream (where a rank reduces a unit's gradient and takes its shard's norm) and the compute stream
(where a resident unit is updated and the host reads that norm). Here the ranks run the real streams:
the 1.5B two-rank run on the H200 reported gradient norms 10-40 % off on two of six steps while the
losses agreed, because a resident unit's norm was read on the compute stream before the d2h stream
had written it. Every step's norm, every loss and every final parameter must agree with the
single-process run of the same global batch, on the same GPU.

Test: ``pytest tests/distributed/test_dp_gpu.py`` (skipped without a CUDA GPU).
"""

from __future__ import annotations

import pytest
import torch
from dp_ranks import Job, run_ranks, train

from slidekit.testing.asserts import assert_losses_close, assert_states_close, rel_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CASES = {  # family, job settings
    "half resident, clipping, window 2": ("mistral", {"gpu_resident": "0.5", "max_grad_norm": 0.5, "window": 2}),
    "all resident, no clipping": ("llama", {"gpu_resident": "all"}),
    "half resident with sliding weights, adamw_8bit": (
        "qwen2", {"gpu_resident": "0.5", "optimizer": "adamw_8bit", "engine": {"resident_weights": "slide"}},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_two_ranks_on_one_gpu_equal_one_process(case, tiny_model):
    family, settings = CASES[case]
    job = Job(
        model_dir=str(tiny_model(family)),
        ranks=2,
        steps=6,
        device="cuda",
        backend="gloo",  # NCCL refuses two ranks on one device
        timeout_s=120.0,
        **settings,
    )
    ref = run_ranks(train, 1, job, timeout=300.0)[0].ok()
    outs = [o.ok() for o in run_ranks(train, 2, job, timeout=300.0)]
    rtol = 1e-5 if job.optimizer == "layer_adam" else 1e-4  # 8-bit moments: a last-bit change moves a code
    for out in outs:
        # The norm sums each rank's squared shard norms: only the order of the additions differs.
        assert_losses_close(out["grad_norms"], ref["grad_norms"], rtol=1e-5)
        assert_losses_close(out["losses"], ref["losses"], rtol=1e-5)
        assert_states_close(out["state"], ref["state"], rtol=rtol)
    assert max(rel_error(ref["state"][n], ref["init"][n]) for n in ref["state"]) > 1e-4

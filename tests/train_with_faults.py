"""train.py with injected faults, for the tests of what the loop does with them (not collected by pytest).

    MT_NAN_GRAD_STEPS=3,4 python tests/train_with_faults.py --job.config_file ...   # NaN in one gradient of rank 0
    MT_NAN_PARAM_STEP=3 python tests/train_with_faults.py ...                       # inf in a weight after the step

Steps count from 1 in this process (a run that starts from scratch). Everything else is the real train.main.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import train  # noqa: E402
from components.moe_balance import MoEBalancer  # noqa: E402

NAN_GRAD_STEPS = {int(s) for s in os.environ.get("MT_NAN_GRAD_STEPS", "").split(",") if s}
NAN_PARAM_STEP = int(os.environ.get("MT_NAN_PARAM_STEP", "0"))
_calls = {"norm": 0, "after_step": 0}
_real_norm, _real_after_step, _real_build = train.global_grad_norm, MoEBalancer.after_step, train.build_model_parts
_parts = []


def norm_with_nan(params, *args, **kwargs):
    _calls["norm"] += 1
    if _calls["norm"] in NAN_GRAD_STEPS and int(os.environ.get("RANK", 0)) == 0:
        grad = next(p.grad for p in params if p.grad is not None)
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        local.view(-1)[0] = float("nan")
    return _real_norm(params, *args, **kwargs)


def after_step_then_poison(self, *args, **kwargs):  # called right after the optimizer step
    _calls["after_step"] += 1
    if _calls["after_step"] == NAN_PARAM_STEP:
        with torch.no_grad():
            for part in _parts:
                p = next(part.parameters())
                (p.to_local() if hasattr(p, "to_local") else p).view(-1)[0] = float("inf")
    return _real_after_step(self, *args, **kwargs)


def build_and_remember(*args, **kwargs):
    model = _real_build(*args, **kwargs)
    _parts.extend(model.parts)
    return model


train.global_grad_norm, train.build_model_parts = norm_with_nan, build_and_remember
MoEBalancer.after_step = after_step_then_poison

if __name__ == "__main__":
    train.main(sys.argv[1:])

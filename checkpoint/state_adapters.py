"""Stateful adapters that CheckpointManager hands to DCP, and the pickle-free encoding of their state.

Why pickle-free: DCP stores every non-tensor value of a state dict with torch.save and loads it with
`torch.load(weights_only=False)`, i.e. it unpickles it, and unpickling runs whatever code the bytes name. So
everything we save is a tensor: tensors stay tensors, and the rest of a state dict (ints, floats, strings,
lists, dicts) becomes ONE uint8 tensor of UTF-8 JSON under the key "json" (`JsonTensorState`). DCP loads
tensors with `torch.load(weights_only=True)`. What remains a pickle is DCP's own `.metadata` (see README,
"Checkpoints": which files are trusted).

Optimizer hyperparameters and the LR schedule are NOT restored from a checkpoint: the optimizer's state
tensors (moments, step) and the scheduler's step count are, and the learning rate, weight decay, betas and
the schedule come from the current config. So `--optimizer.lr 1e-4` on resume takes effect (the run record's
comparison logs every such change; checkpoint/run_record.py).

Checkpoints written before this encoding ("legacy": no "train_state.json" key) still load: their non-tensor
items are read as DCP always did (unpickled), with a warning.
"""

from __future__ import annotations

import json
import logging
import pickle
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

logger = logging.getLogger(__name__)

JSON_KEY = "json"
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


# ------------------------------------------------------------------------------------------- JSON in a tensor
def json_to_tensor(obj, what: str) -> torch.Tensor:
    """uint8 [n] tensor of obj as UTF-8 JSON; a clear error for values JSON cannot hold."""
    try:
        text = json.dumps(obj, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"the {what} state cannot be checkpointed without pickle ({e}): keep it to tensors (top level) and "
            "numbers, strings, bools, None, lists and dicts"
        ) from e
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def tensor_to_json(t: torch.Tensor):
    return json.loads(t.cpu().numpy().tobytes().decode("utf-8"))


class JsonTensorState:
    """Stateful wrapper: `inner`'s top-level tensors saved as themselves, every other value inside one uint8
    tensor of JSON (key "json"). Invariant: nothing saved through it is a non-tensor DCP item.

    Loading needs the JSON tensor's length before DCP reads it: the manager sets `json_numel` from the
    checkpoint's metadata (`prepare_load`) and resets it afterwards.
    """

    def __init__(self, inner: Stateful, what: str):
        self.inner, self.what = inner, what
        self.json_numel: int | None = None

    def prepare_load(self, json_numel: int | None) -> None:
        self.json_numel = json_numel

    def state_dict(self) -> dict:
        sd = self.inner.state_dict()
        if JSON_KEY in sd:
            raise KeyError(f"the {self.what} state may not use the key {JSON_KEY!r} (reserved for its JSON part)")
        tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
        if self.json_numel is not None:  # a load target: DCP fills it in place
            return {**tensors, JSON_KEY: torch.empty(self.json_numel, dtype=torch.uint8)}
        plain = {k: v for k, v in sd.items() if k not in tensors}
        return {**tensors, JSON_KEY: json_to_tensor(plain, self.what)}

    def load_state_dict(self, state_dict: dict) -> None:
        plain = tensor_to_json(state_dict[JSON_KEY])
        self.inner.load_state_dict({**plain, **{k: v for k, v in state_dict.items() if k != JSON_KEY}})


# ----------------------------------------------------------------------------------------------- adapters
class OptimizerState:
    """Stateful adapter: flattened FQN-keyed optimizer state tensors ("state.<fqn>.exp_avg") merged over
    (model part, optimizer) pairs. Flattened keys are per parameter, so a rank owning a subset of the
    parameters (pipeline stage, other FSDP degree) picks exactly its own on load.

    Only "state.*" is saved; the param groups (lr, weight decay, betas, ...) come from the optimizer as built
    from the current config when loading (non-tensor values: they would be pickled, and the config should win).
    """

    def __init__(self, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
        if len(optimizers) != len(model_parts):
            raise ValueError(
                f"got {len(optimizers)} optimizers for {len(model_parts)} model parts: pass one optimizer per part"
            )
        self.pairs = list(zip(model_parts, optimizers))

    def state_dict(self) -> dict:
        merged: dict = {}
        for model, optim in self.pairs:
            for k, v in get_optimizer_state_dict(model, optim, options=_FLAT).items():
                if not k.startswith("state."):
                    continue
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"optimizer state {k} is a {type(v).__name__}, not a tensor: it would be pickled")
                merged[k] = v
        return merged

    def load_state_dict(self, state_dict: dict) -> None:
        for model, optim in self.pairs:
            current = get_optimizer_state_dict(model, optim, options=_FLAT)
            groups = {k: v for k, v in current.items() if k.startswith("param_groups.")}
            set_optimizer_state_dict(model, optim, optim_state_dict={**state_dict, **groups}, options=_FLAT)


class SchedulerState:
    """Stateful adapter: every part's LR scheduler steps identically, so one state is saved, all are loaded.

    LambdaLR only (the lr is base_lr x f(step)). Load restores the step count alone and recomputes the lr
    from the current base lrs and schedule function, so a changed optimizer.lr / lr_scheduler.* /
    training.steps applies from the first resumed step.
    """

    def __init__(self, lr_schedulers: list):
        self.lr_schedulers = list(lr_schedulers)
        for sched in self.lr_schedulers:
            if not isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
                raise TypeError(
                    f"checkpointing supports LambdaLR schedulers (lr = base_lr x f(step)); got {type(sched).__name__}"
                )

    def state_dict(self) -> dict:
        # lr_lambdas holds the functions' __dict__ (not JSON); the functions come from the config
        return {k: v for k, v in self.lr_schedulers[0].state_dict().items() if k != "lr_lambdas"}

    def load_state_dict(self, state_dict: dict) -> None:
        for sched in self.lr_schedulers:
            sched.last_epoch = int(state_dict["last_epoch"])
            sched._step_count = int(state_dict["_step_count"])
            lrs = [base * fn(sched.last_epoch) for fn, base in zip(sched.lr_lambdas, sched.base_lrs)]
            for group, lr in zip(sched.optimizer.param_groups, lrs):
                group["lr"] = lr
            sched._last_lr = lrs


class TrainState:
    """Stateful adapter: the step (an int64 tensor, key "step") and `extra_state` (values may be Stateful
    objects or plain JSON-able values; plain ones are replaced in the dict in place on load)."""

    def __init__(self, extra_state: dict | None):
        self.step = 0
        self.extra_state = extra_state if extra_state is not None else {}
        if "step" in self.extra_state:
            raise ValueError("extra_state may not use the key 'step' (the train step is saved under it)")
        self.load_only: set[str] | None = None  # legacy checkpoints: the extra keys present in it

    def state_dict(self) -> dict:
        sd: dict = {"step": torch.tensor(self.step, dtype=torch.int64)}
        for k, v in self.extra_state.items():
            if self.load_only is None or k in self.load_only:
                sd[k] = v.state_dict() if isinstance(v, Stateful) else v
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = int(state_dict["step"])
        for k in sorted(set(self.extra_state) - set(state_dict)):
            logger.warning(f"the checkpoint has no train_state.{k}; keeping its current value")
        for k, v in state_dict.items():
            if k == "step":
                continue
            if isinstance(self.extra_state.get(k), Stateful):
                self.extra_state[k].load_state_dict(v)
            else:
                self.extra_state[k] = v


def host_rng_state() -> dict:
    """numpy's and python's global RNG states as JSON-able dicts (MT19937 key + position + gaussian cache)."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "numpy": {
            "kind": kind,
            "key": key.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
    }


def set_host_rng_state(state: dict) -> None:
    n, p = state["numpy"], state["python"]
    np.random.set_state((n["kind"], np.asarray(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))


class RNGState:
    """Stateful adapter: rank 0's RNG states, broadcast so every rank saves (and later restores) the same.
    torch / cuda states are uint8 tensors; numpy / python ones JSON (through JsonTensorState)."""

    def __init__(self, process_group=None):
        self.process_group = process_group

    def state_dict(self) -> dict:
        sd = {"torch": torch.get_rng_state(), **host_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state()
        if dist.is_initialized():
            box = [sd]
            dist.broadcast_object_list(box, src=0, group=self.process_group)  # in memory, rank 0 -> all
            sd = box[0]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        torch.set_rng_state(state_dict["torch"])
        if "host" in state_dict:  # legacy checkpoint: DCP has already unpickled this item from the same file
            np_state, py_state = pickle.loads(state_dict["host"])
            np.random.set_state(np_state)
            random.setstate(py_state)
        else:
            set_host_rng_state(state_dict)
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


class LegacyRNGTarget:
    """Load target for a legacy checkpoint's rng entry: {"torch", "host" (pickled numpy / python states),
    "cuda" when it was saved (`cuda_numel`, from the checkpoint's metadata)}."""

    def __init__(self, rng: RNGState, cuda_numel: int | None):
        self.rng, self.cuda_numel = rng, cuda_numel

    def state_dict(self) -> dict:
        sd = {"torch": torch.get_rng_state(), "host": b""}  # a non-tensor target: DCP reads that item as bytes
        if self.cuda_numel is not None:
            sd["cuda"] = torch.empty(self.cuda_numel, dtype=torch.uint8)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        self.rng.load_state_dict(state_dict)

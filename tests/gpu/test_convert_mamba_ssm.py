"""On CUDA with mamba_ssm: a random MambaLMHeadModel (Mamba-2 layers) converted to our format and back gives
the same logits as ours (bf16-level tolerance), ngroups 1 / 2, tied / untied, vocabulary padding included."""

from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
mamba_ssm = pytest.importorskip("mamba_ssm")

from checkpoint.convert import import_checkpoint, main, read_dcp_weights  # noqa: E402
from models import Mamba2LM  # noqa: E402
from models.args import ModelArgs  # noqa: E402


def _their_model(ngroups: int, tie: bool):
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    torch.manual_seed(0)
    cfg = MambaConfig(
        d_model=128,
        d_intermediate=0,
        n_layer=3,
        vocab_size=250,
        pad_vocab_size_multiple=16,
        ssm_cfg={"layer": "Mamba2", "d_state": 32, "headdim": 32, "ngroups": ngroups, "chunk_size": 64},
        rms_norm=True,
        residual_in_fp32=True,
        fused_add_norm=True,
        tie_embeddings=tie,
    )
    model = MambaLMHeadModel(cfg, device="cuda", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D")):
                p.add_(torch.randn_like(p) * 0.1)  # make the norms and D visible to the comparison
    return model


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("ngroups,tie", [(1, True), (2, False)])
def test_mamba_ssm_both_ways(tmp_path, ngroups, tie):
    theirs = _their_model(ngroups, tie)
    # what MambaLMHeadModel.save_pretrained writes: config.json (the MambaConfig fields) + pytorch_model.bin
    (tmp_path / "ssm").mkdir()
    (tmp_path / "ssm" / "config.json").write_text(json.dumps(dict(vars(theirs.config))))
    torch.save(theirs.state_dict(), tmp_path / "ssm" / "pytorch_model.bin")
    args = import_checkpoint(str(tmp_path / "ssm"), str(tmp_path / "dcp"), "mamba_ssm")
    assert isinstance(args, ModelArgs) and args.padded_vocab_size == 256 and args.tie_embeddings == tie
    with torch.device("cuda"):
        ours = Mamba2LM(args)
    ours.load_state_dict(read_dcp_weights(str(tmp_path / "dcp")))
    ours.eval()
    x = torch.randint(0, 250, (2, 200), device="cuda")  # not a multiple of chunk_size
    with torch.no_grad():
        ref = theirs(x).logits
        assert _rel_err(ours(x), ref) < 1e-2
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref_bf16 = theirs(x).logits
            assert _rel_err(ours(x), ref_bf16) < 3e-2
    # ours -> mamba_ssm: load into a fresh MambaLMHeadModel from the exported config.json + pytorch_model.bin
    main(["to-mamba-ssm", str(tmp_path / "dcp"), str(tmp_path / "back")])
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    cfg = MambaConfig(**json.loads((tmp_path / "back" / "config.json").read_text()))
    back = MambaLMHeadModel(cfg, device="cuda", dtype=torch.float32).eval()
    back.load_state_dict(torch.load(tmp_path / "back" / "pytorch_model.bin", map_location="cuda", weights_only=True))
    with torch.no_grad():
        assert _rel_err(back(x).logits, ref) < 1e-5

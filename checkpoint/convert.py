"""Import / export of Mamba-2 weights: mamba_ssm and HF transformers folders <-> our weights-only DCP folders.

    python -m checkpoint.convert from-mamba-ssm state-spaces/mamba2-130m  weights/130m  [--untie] [--dtype float32]
    python -m checkpoint.convert from-hf        hf_mamba2_folder          weights/hf    [--untie]
    python -m checkpoint.convert to-hf          outputs/checkpoint/step-1000 hf_out  [--config job.toml] \\
                                                                                  [--dtype bfloat16]
    python -m checkpoint.convert to-mamba-ssm   weights/130m              ssm_out       [--model.d_model 768 ...]

An import writes a weights-only DCP folder (what checkpoint.initial_load_path loads, under any layout) and,
inside it, `model.toml`: the [model] section (flavor + overrides) the trainer needs for these weights, with
tokenizer_path = the source's tokenizer.json when the folder has one. An
export reads a training checkpoint (step-N) or a weights-only folder in one process (no process group), and
needs the model's [model] section: `--config FILE` (a job TOML or a model.toml), by default the folder's own
model.toml; `--model.<key> value` overrides it. The HF export also takes the run's tokenizer from that section
(model.tokenizer_path, '' = the byte tokenizer): its bos / eos / pad ids go into config.json and
generation_config.json, and a tokenizer.json run's tokenizer files are copied beside the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from checkpoint.export import (
    DTYPES,
    parse_dtype,
    read_metadata,
    read_model_tensors,
    write_weights_folder,
)
from checkpoint.formats import (
    UnsupportedCheckpoint,
    args_from_hf_config,
    args_from_mamba_ssm_config,
    foreign_to_ours,
    hf_config_from_args,
    mamba_ssm_config_from_args,
    model_toml,
    ours_to_foreign,
)
from checkpoint.run_record import read_record
from configs.parser import load_config
from data.tokenizer import HFTokenizer, build_tokenizer
from models import build_model_on_meta
from models.args import ModelArgs, build_model_args

MODEL_TOML = "model.toml"
_MAX_SHARD_BYTES = 5 * 2**30  # HF's customary safetensors shard size


# ------------------------------------------------------------------------------------------ reading
def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: a mamba_ssm / HF model folder holds config.json beside the weights"
        )
    with open(path) as f:
        return json.load(f)


def read_foreign_weights(folder: str) -> dict[str, torch.Tensor]:
    """The tensors of a HF / mamba_ssm folder: model.safetensors(.index.json) or pytorch_model.bin(.index.json)."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"model folder {folder} does not exist (or is not a folder)")

    def at(name):
        return os.path.join(folder, name)

    def sharded(index_name, load_one):
        weight_map = _read_json(at(index_name))["weight_map"]
        sd: dict = {}
        for shard in sorted(set(weight_map.values())):
            if not os.path.isfile(at(shard)):
                raise FileNotFoundError(f"{at(shard)} (a shard listed in {index_name}) is missing")
            sd.update(load_one(at(shard)))
        return sd

    def load_bin(path):
        return torch.load(path, map_location="cpu", weights_only=True)

    if os.path.isfile(at("model.safetensors.index.json")):
        return sharded("model.safetensors.index.json", load_file)
    if os.path.isfile(at("model.safetensors")):
        return load_file(at("model.safetensors"))
    if os.path.isfile(at("pytorch_model.bin.index.json")):
        return sharded("pytorch_model.bin.index.json", load_bin)
    if os.path.isfile(at("pytorch_model.bin")):
        return load_bin(at("pytorch_model.bin"))
    raise FileNotFoundError(
        f"{folder} holds no weights: expected model.safetensors, model.safetensors.index.json (+ shards) or "
        f"pytorch_model.bin"
    )


def read_checkpoint_metadata(path: str):
    """The DCP metadata of a step-N / weights-only folder; a clear error for the checkpoint.folder above them."""
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, ".metadata")):
        steps = sorted(n for n in os.listdir(path) if n.startswith("step-"))
        if steps:
            raise FileNotFoundError(
                f"{path} is a checkpoint.folder, not a checkpoint: pick one of its step-N "
                f"folders, e.g. {os.path.join(path, steps[-1])}"
            )
    return read_metadata(path)


def read_dcp_weights(path: str) -> dict[str, torch.Tensor]:
    """Model tensors of a training checkpoint (step-N) or weights-only DCP folder, FQN-keyed, on the CPU."""
    return read_model_tensors(path, read_checkpoint_metadata(path))


def write_dcp_weights(sd: dict[str, torch.Tensor], out_dir: str, extra_files: dict[str, str] | None = None) -> None:
    """A weights-only DCP folder (complete or absent: written to <out>.partial and renamed), plus text files."""
    write_weights_folder(sd, out_dir, extra_files=extra_files)


# ------------------------------------------------------------------------------------------ checks
def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Our state-dict keys and shapes for these args (lm_head.weight included, tied or not)."""
    return {k: tuple(v.shape) for k, v in build_model_on_meta(args).state_dict().items()}


def check_shapes(sd: dict, args: ModelArgs, where: str) -> None:
    want = expected_shapes(args)
    if args.tie_embeddings and "lm_head.weight" not in sd:  # our checkpoints hold a tied weight once
        del want["lm_head.weight"]
    missing = sorted(set(want) - set(sd))
    extra = sorted(set(sd) - set(want))
    bad = [f"{k}: {tuple(sd[k].shape)} (expected {want[k]})" for k in want if k in sd and tuple(sd[k].shape) != want[k]]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors, e.g. {missing[:4]}")
    if extra:
        problems.append(f"{len(extra)} unexpected tensors, e.g. {extra[:4]}")
    if bad:
        problems.append(f"{len(bad)} shapes that don't fit the config, e.g. {bad[:4]}")
    if problems:
        raise ValueError(
            f"{where}: " + "; ".join(problems) + ". The weights and the model config disagree "
            "(d_model, n_layers, d_state, ngroups, headdim, expand, vocab / pad_vocab_size_multiple)."
        )


# ------------------------------------------------------------------------------------------ import
def import_checkpoint(
    src: str, out_dir: str, fmt: str, untie: bool = False, dtype: str | torch.dtype = "float32"
) -> ModelArgs:
    """mamba_ssm ("mamba_ssm") or HF ("hf") folder -> weights-only DCP folder + model.toml. Returns the ModelArgs."""
    cfg = _read_json(os.path.join(src, "config.json"))
    fields = args_from_mamba_ssm_config(cfg) if fmt == "mamba_ssm" else args_from_hf_config(cfg)
    sd = foreign_to_ours(read_foreign_weights(src), fmt)
    tied = fields["tie_embeddings"]
    if "tok_embeddings.weight" not in sd:
        raise ValueError(f"{src}: no embedding tensor (backbone.embedding(s).weight) in the weights")
    if tied and "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"], sd["tok_embeddings.weight"]):
        raise ValueError(
            f"{src}: config says tied embeddings but lm_head.weight differs from the embedding; "
            f"fix tie_embeddings / tie_word_embeddings in config.json"
        )
    if tied:
        sd["lm_head.weight"] = sd["tok_embeddings.weight"]
        if untie:  # the head becomes a weight of its own (e.g. to fine-tune it apart from the embedding)
            fields["tie_embeddings"] = False
            sd["lm_head.weight"] = sd["tok_embeddings.weight"].clone()
    args = ModelArgs(**fields)
    errs = args.validate()
    if errs:
        raise ValueError(f"{src}/config.json gives an invalid model: " + "; ".join(errs))
    check_shapes(sd, args, src)
    dt = parse_dtype(dtype)
    sd = {k: v.to(dt) if v.is_floating_point() else v for k, v in sd.items()}
    if (
        args.tie_embeddings
    ):  # one tensor per logical weight, as our checkpoints hold it (the head loads through the tie)
        sd.pop("lm_head.weight", None)
    label = "mamba_ssm" if fmt == "mamba_ssm" else "HF transformers Mamba2"
    tokenizer_json = os.path.abspath(os.path.join(src, "tokenizer.json"))
    tokenizer_path = tokenizer_json if os.path.isfile(tokenizer_json) else ""
    write_dcp_weights(
        sd, out_dir, {MODEL_TOML: model_toml(fields, f"{label} checkpoint {os.path.abspath(src)}", tokenizer_path)}
    )
    return args


# ------------------------------------------------------------------------------------------ export
def load_model_section(config_file: str, overrides: list[str] | None = None) -> tuple[ModelArgs, str]:
    """(ModelArgs, model.tokenizer_path) from a TOML file's [model] section (job file or model.toml) and
    `--model.key value` overrides."""
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"model config {config_file} does not exist")
    cfg = load_config(["--job.config_file", config_file, *(overrides or [])])
    return build_model_args(cfg.model.flavor, cfg.model_overrides), cfg.model.tokenizer_path


def model_section_from_record(record: dict, overrides: list[str], src: str) -> tuple[ModelArgs, str]:
    """(ModelArgs, model.tokenizer_path) from a step-N folder's run_record.json; of the overrides only
    --model.tokenizer_path applies (the weights fix every other model field)."""
    tokenizer_path = record["job_config"]["model"]["tokenizer_path"]
    pairs = dict(zip(overrides[::2], overrides[1::2]))
    if len(overrides) % 2 or set(pairs) - {"--model.tokenizer_path"}:
        raise ValueError(
            f"{src} is exported with the model of its run_record.json; only --model.tokenizer_path "
            f"may be overridden (got {' '.join(overrides)}); pass --config to use another [model]"
        )
    return ModelArgs(**record["model_args"]), pairs.get("--model.tokenizer_path", tokenizer_path)


# Copied from beside a run's tokenizer.json when present (transformers' AutoTokenizer reads them).
_HF_TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def hf_token_ids(tokenizer_path: str, args: ModelArgs) -> dict[str, int]:
    """bos / eos / pad ids of the run's tokenizer ('' = the byte tokenizer), keyed as HF configs spell them.

    pad = eos when the tokenizer has none (data/tokenizer.py's rule); bos = the byte tokenizer's bos, else
    tokenizer_config.json's bos_token, else eos (the packer separates documents with EOS and adds no BOS).
    """
    tok = build_tokenizer(tokenizer_path)
    if tok.vocab_size > args.vocab_size:
        raise ValueError(
            f"the tokenizer ({tokenizer_path or 'the built-in byte tokenizer'}) has {tok.vocab_size} "
            f"tokens but the model only {args.vocab_size}: this is not the run's tokenizer; pass "
            f"--model.tokenizer_path with the tokenizer.json the run trained with"
        )
    bos = getattr(tok, "bos_id", None)
    if bos is None:
        bos = _configured_token_id(tok.path, "bos_token")
    return {"bos_token_id": tok.eos_id if bos is None else bos, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}


def _configured_token_id(tokenizer_json: str, key: str) -> int | None:
    """The id of tokenizer_config.json's `key` token (a string or {"content": ...}) beside tokenizer_json."""
    config_file = os.path.join(os.path.dirname(tokenizer_json), "tokenizer_config.json")
    if not os.path.isfile(config_file):
        return None
    name = _read_json(config_file).get(key)
    name = name.get("content") if isinstance(name, dict) else name
    return Tokenizer.from_file(tokenizer_json).token_to_id(name) if isinstance(name, str) else None


def write_hf_tokenizer_files(tokenizer_path: str, folder: str, ids: dict[str, int]) -> list[str]:
    """Copy a tokenizer.json run's tokenizer files into folder; none for the byte tokenizer (no HF file holds it).

    Without a tokenizer_config.json beside tokenizer.json, one is written that names the generic fast tokenizer
    and the special tokens: transformers would otherwise pick GPT-NeoX's class for model_type mamba2, which does
    not read this tokenizer.json as it is.
    """
    if not tokenizer_path:
        return []
    tokenizer_json = HFTokenizer(tokenizer_path).path
    src_dir = os.path.dirname(tokenizer_json)
    shutil.copyfile(tokenizer_json, os.path.join(folder, "tokenizer.json"))
    files = ["tokenizer.json"]
    for name in _HF_TOKENIZER_SIDE_FILES:
        if os.path.isfile(os.path.join(src_dir, name)):
            shutil.copyfile(os.path.join(src_dir, name), os.path.join(folder, name))
            files.append(name)
    if "tokenizer_config.json" not in files:
        tok = Tokenizer.from_file(tokenizer_json)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **{k.removesuffix("_id"): tok.id_to_token(v) for k, v in ids.items()},
        }
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2)
        files.append("tokenizer_config.json")
    return files


def export_checkpoint(
    dcp_path: str,
    out_dir: str,
    fmt: str,
    args: ModelArgs,
    dtype: str | torch.dtype = "float32",
    max_shard_bytes: int = _MAX_SHARD_BYTES,
    tokenizer_path: str | None = None,
) -> list[str]:
    """Our DCP folder -> HF ("hf": model.safetensors + config.json) or mamba_ssm ("mamba_ssm": pytorch_model.bin
    + config.json). Returns the files written.

    tokenizer_path (HF only) is the run's model.tokenizer_path ('' = the byte tokenizer): its bos / eos / pad ids
    go into config.json and a generation_config.json, and a tokenizer.json's files are copied. None (weights
    alone, tokenizer unknown) writes no ids, so transformers' Mamba2Config defaults apply; the CLI always has one.
    """
    config = hf_config_from_args(args) if fmt == "hf" else mamba_ssm_config_from_args(args)
    read_checkpoint_metadata(dcp_path)  # a wrong path is named before the tokenizer is judged
    token_ids = hf_token_ids(tokenizer_path, args) if fmt == "hf" and tokenizer_path is not None else {}
    config.update(token_ids)
    sd = read_dcp_weights(dcp_path)
    check_shapes(sd, args, dcp_path)
    dt = parse_dtype(dtype)
    sd = {k: v.to(dt).contiguous() if v.is_floating_point() else v for k, v in sd.items()}
    if args.tie_embeddings:
        sd["lm_head.weight"] = sd["tok_embeddings.weight"]  # one tensor, as in the tied source model
    foreign = ours_to_foreign(sd, fmt)
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another output folder")
    tmp = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if fmt == "hf":
        config["torch_dtype"] = str(dt).removeprefix("torch.")
        if args.tie_embeddings:
            foreign.pop(
                "lm_head.weight"
            )  # HF re-ties it from the embedding (tie_word_embeddings), as save_pretrained does
        files = _write_safetensors(foreign, tmp, max_shard_bytes)
        if token_ids:
            generation = dict(token_ids)
            if args.padded_vocab_size > args.vocab_size:  # rows that pad the vocabulary are no tokens: never emit them
                generation["suppress_tokens"] = list(range(args.vocab_size, args.padded_vocab_size))
            with open(os.path.join(tmp, "generation_config.json"), "w") as f:  # generate() reads its defaults here
                json.dump(generation, f, indent=2)
            files += ["generation_config.json", *write_hf_tokenizer_files(tokenizer_path, tmp, token_ids)]
    else:
        torch.save(foreign, os.path.join(tmp, "pytorch_model.bin"))  # tied: both keys share one storage
        files = ["pytorch_model.bin"]
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    os.rename(tmp, out_dir)
    return ["config.json", *files]


def _write_safetensors(sd: dict[str, torch.Tensor], folder: str, max_shard_bytes: int) -> list[str]:
    shards: list[dict] = [{}]
    size = 0
    for k in sorted(sd):
        nbytes = sd[k].numel() * sd[k].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = sd[k]
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in sd.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return [*names, "model.safetensors.index.json"]


# ------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m checkpoint.convert",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, fmt in (("from-mamba-ssm", "mamba_ssm"), ("from-hf", "hf")):
        s = sub.add_parser(name, help=f"{fmt} folder (config.json + weights) -> weights-only DCP folder + model.toml")
        s.add_argument("src", help="folder with config.json and the weights")
        s.add_argument("out", help="output DCP folder (must not exist)")
        s.add_argument(
            "--untie",
            action="store_true",
            help="give lm_head its own copy of the tied embedding, trained apart from it from then on (pipeline "
            "parallel does not need this: it keeps tied weights tied)",
        )
        s.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the stored weights")
        s.set_defaults(fmt=fmt)
    for name, fmt in (("to-hf", "hf"), ("to-mamba-ssm", "mamba_ssm")):
        s = sub.add_parser(
            name,
            help=f"DCP (step-N or weights-only) -> {fmt} folder; extra --model.<key> value "
            f"arguments override the [model] config",
        )
        s.add_argument("src", help="a step-N checkpoint folder or a weights-only DCP folder")
        s.add_argument("out", help="output folder (must not exist)")
        s.add_argument("--config", default="", help=f"TOML with the [model] section (default: SRC/{MODEL_TOML})")
        s.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the exported weights")
        s.set_defaults(fmt=fmt)
    args, rest = p.parse_known_args(argv)
    try:
        if args.command.startswith("from-"):
            if rest:
                p.error(f"unrecognized arguments: {' '.join(rest)}")
            margs = import_checkpoint(args.src, args.out, args.fmt, untie=args.untie, dtype=args.dtype)
            print(
                f"wrote {os.path.abspath(args.out)} ({margs.n_layers} layers, d_model {margs.d_model}, "
                f"tied {margs.tie_embeddings}); its [model] section: {os.path.join(args.out, MODEL_TOML)}"
            )
        else:
            bad = [a for a in rest if a.startswith("--") and not a.startswith("--model.")]
            if bad:
                p.error(f"unrecognized arguments: {' '.join(bad)} (only --model.<key> value overrides pass through)")
            config = args.config or os.path.join(args.src, MODEL_TOML)
            record = None if args.config else read_record(args.src)
            if record is not None and not os.path.isfile(config):  # a step-N folder knows its own run
                margs, tokenizer_path = model_section_from_record(record, rest, args.src)
            elif not os.path.isfile(config):
                p.error(
                    f"no model config: {config} does not exist; pass --config with the [model] section of the "
                    f"run that wrote {args.src} (e.g. its job TOML)"
                )
            else:
                margs, tokenizer_path = load_model_section(config, rest)
            files = export_checkpoint(args.src, args.out, args.fmt, margs, args.dtype, tokenizer_path=tokenizer_path)
            print(f"wrote {', '.join(files)} to {os.path.abspath(args.out)}")
            if args.fmt == "hf":
                print(
                    f"token ids from {tokenizer_path or 'the built-in byte tokenizer (model.tokenizer_path empty)'};"
                    f" pass --model.tokenizer_path if the run used another"
                )
    except (UnsupportedCheckpoint, FileNotFoundError, FileExistsError, ValueError) as e:
        raise SystemExit(f"convert error: {e}") from None


if __name__ == "__main__":
    main()

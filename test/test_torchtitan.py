"""torchtitan integration: offline assets, the "fp8flow" converter, the [fp8flow] job config, training.

Everything runs on the CPU: torchtitan 0.2.2's trainer is made to run there by
``fp8flow_ao.torchtitan.cpu`` (it otherwise assumes CUDA), so the TOML configs in
``torchtitan_configs/`` (DeepSeek-V3, Llama 4, Qwen3 MoE) are trained for two steps, BF16 and FP8-Flow
side by side.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("datasets")

import fp8flow_ao.torchtitan as fp8tt  # noqa: E402  (registers the converter and the dataset)
from fp8flow_ao import data  # noqa: E402
from fp8flow_ao.moe import FP8FlowMoE, _routed_experts, is_converted  # noqa: E402
from fp8flow_ao.torchtitan import assets, cpu  # noqa: E402
from fp8flow_ao.torchtitan.converter import FP8FlowConverter, fqn_filter  # noqa: E402
from fp8flow_ao.torchtitan.job_config import FP8Flow  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "torchtitan_configs"
# The BF16 / FP8-Flow TOML pairs, by file-name prefix, with the flavor the CPU trainer test runs
# (None: the TOML's own). Qwen3's debugmodel_moe has 64 experts top-8 in 8 layers: its BF16 and FP8-Flow
# pair took 130 s on this 2-core CPU machine (session 52), a sixth of the CPU suite, so the test runs a
# 2-layer, 8-expert top-4 variant of it (10 s).
FAMILIES = {"deepseek_v3_debug": None, "llama4_debug": None, "qwen3_moe_debug": "debugmodel_moe_cpu_test"}


def pair(family: str) -> tuple[Path, Path]:
    return CONFIGS / f"{family}_bf16.toml", CONFIGS / f"{family}_fp8flow.toml"


def add_qwen3_cpu_flavor() -> None:
    """Register ``debugmodel_moe_cpu_test`` in torchtitan's Qwen3 flavor table (see FAMILIES)."""
    from torchtitan.models.qwen3 import qwen3_args

    base = qwen3_args["debugmodel_moe"]
    moe_args = dataclasses.replace(base.moe_args, num_experts=8, top_k=4)
    qwen3_args.setdefault(FAMILIES["qwen3_moe_debug"], dataclasses.replace(base, n_layers=2, moe_args=moe_args))


@pytest.fixture(scope="module")
def corpus() -> Path:
    """The offline corpus in the default assets directory (built on the first run of a machine, ~6 s)."""
    return data.ensure_corpus()


def parse(*args: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(list(args))


# ------------------------------------------------------------------------------------------------
# Offline assets
# ------------------------------------------------------------------------------------------------


def test_corpus_is_english_prose_in_a_fixed_order(corpus: Path) -> None:
    docs = data.read_corpus(corpus)
    assert len(docs) > 300 and sum(map(len, docs)) > 1_000_000
    text = "\n".join(docs[:50])
    letters = sum(c.isalpha() or c.isspace() for c in text) / len(text)
    assert letters > 0.8, "mostly words, not code"
    assert " the " in text and " is " in text
    # Same order as a fresh walk: the language reference topics first, sorted by name.
    fresh = data.iter_corpus_documents()
    assert [next(fresh) for _ in range(3)] == docs[:3]


def test_packaged_tokenizer_in_torchtitan(corpus: Path) -> None:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(str(assets.TOKENIZER_DIR))
    assert tok.get_vocab_size() == data.VOCAB_SIZE == 2048  # the deepseek_v3 debugmodel's vocab
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    doc = data.read_corpus(corpus)[7]
    ids = tok.encode(doc, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and max(ids) < 2048
    assert tok.decode(ids[1:-1]) == doc  # byte-level BPE: exact round trip
    assert len(ids) < len(doc) / 2.5, "a BPE trained on this corpus compresses it"
    assert (assets.TOKENIZER_DIR / "tokenizer.json").stat().st_size < 1_000_000


def test_assets_cli_builds_corpus_and_tokenizer(tmp_path: Path, corpus: Path, capsys) -> None:
    # A small corpus put in place first (the CLI keeps an existing corpus), so training takes a second.
    small = data.read_corpus(corpus)[:40]
    (tmp_path / data.CORPUS_FILE).write_text("".join(json.dumps({"text": t}) + "\n" for t in small))
    assets.main([str(tmp_path), "--vocab-size", "400"])
    assert "tokenizer:" in capsys.readouterr().out
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(str(tmp_path))
    assert tok.get_vocab_size() == 400 and tok.bos_id == 0 and tok.eos_id == 1
    assert tok.decode(tok.encode(small[3])) == small[3]


def test_token_batches_are_shifted_windows_and_reproducible() -> None:
    tokens = torch.arange(10_000)
    a, b = data.TokenBatches(tokens, 3, 16, seed=1), data.TokenBatches(tokens, 3, 16, seed=1)
    x, y = a.next()
    assert x.shape == y.shape == (3, 16)
    assert torch.equal(y, x + 1)  # labels are the next tokens
    assert torch.equal(x, b.next()[0])
    assert int(x.max()) < a.train.numel()
    held = a.eval_batches(2)
    assert len(held) == 2 and all(int(h[0].min()) >= a.train.numel() for h in held)
    with pytest.raises(ValueError, match="tokens"):
        data.TokenBatches(torch.arange(100), 2, 16, seed=0)


def test_offline_dataset_through_torchtitan(corpus: Path) -> None:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset

    assert fp8tt.DATASET_NAME in DATASETS
    tok = HuggingFaceTokenizer(str(assets.TOKENIZER_DIR))
    ds = HuggingFaceTextDataset(fp8tt.DATASET_NAME, str(corpus.parent), tok, seq_len=32)
    inputs, labels = next(iter(ds))
    assert inputs["input"].shape == labels.shape == (32,)
    assert int(inputs["input"][0]) == tok.bos_id
    assert torch.equal(inputs["input"][1:], labels[:-1])
    with pytest.raises(FileNotFoundError, match="dataset_path"):
        HuggingFaceTextDataset(fp8tt.DATASET_NAME, str(corpus.parent / "missing.jsonl"), tok, seq_len=32)


def test_integer_histc_on_cpu_matches_bincount_and_is_restored() -> None:
    ids = torch.randint(0, 8, (257,))
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.histc(ids, bins=8, min=0, max=8)  # what stops torchtitan's router on the CPU
    with cpu.integer_histc():
        counts = torch.histc(ids, bins=8, min=0, max=8)
        floats = torch.histc(ids.float(), bins=8, min=0, max=8)
    assert counts.dtype == torch.int64 and torch.equal(counts, torch.bincount(ids, minlength=8))
    assert torch.equal(floats, counts.float())
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.histc(ids, bins=8, min=0, max=8)


def test_compiling_inside_integer_histc_leaves_torch_histc_compilable() -> None:
    """Dynamo's rule map, built at a process's first compile on torch 2.11, once got built inside the block and
    held the wrapper instead of ``torch.histc``: every later compile that reached ``torch.histc`` failed for the
    rest of the process (on an H200, every whole-layer compile test after the compiled GPU demo)."""
    from torch._dynamo import trace_rules

    def counts(ids: torch.Tensor) -> torch.Tensor:
        return torch.histc(ids, bins=4, min=0, max=4)

    ids = torch.tensor([0, 1, 1, 3])
    trace_rules.get_torch_obj_rule_map.cache_clear()  # as a torch 2.11 process starts
    try:
        with cpu.integer_histc():
            inside = torch.compile(counts, fullgraph=True, backend="eager")(ids)
        torch._dynamo.reset()
        after = torch.compile(counts, fullgraph=True, backend="eager")(ids.float())
    finally:
        torch._dynamo.reset()
        trace_rules.get_torch_obj_rule_map.cache_clear()
        trace_rules.get_torch_obj_rule_map()  # rebuilt with torch.histc itself for the tests that follow
    assert inside.tolist() == [1, 2, 0, 1] and after.tolist() == [1.0, 2.0, 0.0, 1.0]


def test_torchtitan_on_cpu_rebinds_device_names_and_restores_them() -> None:
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as utils

    before = (utils.device_type, dist_utils.device_type, utils.has_cuda_capability)
    with cpu.torchtitan_on_cpu("deepseek_v3"):
        from torchtitan.models.deepseek_v3.model import args

        assert utils.device_type == dist_utils.device_type == "cpu"
        assert dist_utils.device_module.get_device_name() == "cpu"
        assert not args.has_cuda_capability(9, 0), "a GPU machine's CPU run must not pick CUDA-only kernels"
    assert (utils.device_type, dist_utils.device_type, utils.has_cuda_capability) == before
    assert args.has_cuda_capability is utils.has_cuda_capability


# ------------------------------------------------------------------------------------------------
# Converter and job config
# ------------------------------------------------------------------------------------------------


def test_converter_is_registered_once() -> None:
    from torchtitan.protocols import model_converter

    assert model_converter._registry_model_converter_cls["fp8flow"] is FP8FlowConverter
    fp8tt.register()  # again, as a second custom_import would: no "already registered" assertion
    assert model_converter._registry_model_converter_cls["fp8flow"] is FP8FlowConverter


@pytest.mark.parametrize("family", list(FAMILIES))
def test_job_config_sections_parse_and_configs_differ_only_in_fp8flow(family: str) -> None:
    bf16_toml, fp8_toml = pair(family)
    bf16, fp8 = parse("--job.config_file", str(bf16_toml)), parse("--job.config_file", str(fp8_toml))
    assert bf16.model.converters == [] and fp8.model.converters == ["fp8flow"]
    assert fp8.fp8flow == FP8Flow() and bf16.fp8flow == FP8Flow()
    assert fp8.training.dataset == fp8tt.DATASET_NAME and fp8.experimental.custom_import == "fp8flow_ao.torchtitan"
    assert Path(REPO, fp8.model.hf_assets_path) == assets.TOKENIZER_DIR
    a, b = dataclasses.asdict(bf16), dataclasses.asdict(fp8)
    differing = {(s, k) for s in a for k in a[s] if a[s][k] != b[s][k]}
    assert differing == {
        ("job", "config_file"),
        ("job", "dump_folder"),
        ("job", "description"),
        ("model", "converters"),
    }
    cli = parse(
        "--job.config_file",
        str(fp8_toml),
        "--fp8flow.recipe",
        "rowwise",
        "--fp8flow.filter_fqns",
        "layers.1.,layers.3.",
        "--fp8flow.compile_mode",
        "reduce-overhead",
    )
    assert cli.fp8flow.recipe == "rowwise" and cli.fp8flow.filter_fqns == ["layers.1.", "layers.3."]
    assert cli.fp8flow.compile_mode == "reduce-overhead"


def test_job_config_section_comes_from_the_custom_module_only() -> None:
    plain = parse("--model.name", "deepseek_v3")
    assert not hasattr(plain, "fp8flow")
    with_module = parse("--job.custom_config_module", "fp8flow_ao.torchtitan.job_config", "--fp8flow.recompute_experts")
    assert with_module.fp8flow.recompute_experts is True
    # Without the section the converter warns and uses the defaults.
    assert FP8FlowConverter(plain, None).options == FP8Flow()


def test_converter_options_reach_fp8flow_config() -> None:
    cfg = parse("--job.custom_config_module", "fp8flow_ao.torchtitan.job_config", "--fp8flow.recompute_experts")
    config = FP8FlowConverter(cfg, None).config()
    assert config.recompute_experts is True and config.recipe == "blockwise" and config.module_filter is None
    cfg.fp8flow.recipe = "fp4"
    with pytest.raises(ValueError, match="fp8flow.recipe"):
        FP8FlowConverter(cfg, None)
    cfg = parse("--job.custom_config_module", "fp8flow_ao.torchtitan.job_config", "--fp8flow.backward", "bf16")
    assert FP8FlowConverter(cfg, None).config().backward == "bf16"
    keep = fqn_filter(["layers.2."])
    assert keep(None, "layers.1.moe") and not keep(None, "layers.2.moe")
    assert fqn_filter([]) is None
    with pytest.raises(TypeError, match="must be a list of FQN substrings, got the string 'layers.1.'"):
        fqn_filter("layers.1.")  # a TOML string, which torchtitan passes on unchecked


def test_weight_cache_option_reaches_the_layers_and_the_hook_drops_the_cache() -> None:
    from fp8flow_ao.weight_cache import EXPERT_WEIGHT_CACHE

    cfg = parse("--job.custom_config_module", "fp8flow_ao.torchtitan.job_config", "--fp8flow.weight_cache", "step")
    converter = FP8FlowConverter(cfg, None)
    assert converter.config().weight_cache == "step"
    w = torch.nn.Parameter(torch.randn(128, 128))
    EXPERT_WEIGHT_CACHE.get((w,), w.detach().clone)
    converter.post_optimizer_hook(torch.nn.Module())  # after the optimizer step: every FP8 copy dropped
    assert len(EXPERT_WEIGHT_CACHE) == 0
    cfg.fp8flow.weight_cache = "always"
    with pytest.raises(ValueError, match="weight_cache must be one of"):
        FP8FlowConverter(cfg, None).config()


def debug_args(n_layers: int = 3):
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    args = dataclasses.replace(deepseekv3_args["debugmodel"], n_layers=n_layers, max_seq_len=32)
    args.moe_args = dataclasses.replace(args.moe_args, use_grouped_mm=False)  # torchtitan's choice off sm90
    args.moe_impl = "standard"  # set by update_from_config in a torchtitan run
    return args


def test_converter_on_meta_model_then_materialize_and_train() -> None:
    """torchtitan's order: build on meta, convert, to_empty, init_weights; then a training step."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    cfg = parse("--job.custom_config_module", "fp8flow_ao.torchtitan.job_config", "--fp8flow.filter_fqns", "layers.2.")
    with torch.device("meta"):
        model = DeepSeekV3Model(debug_args())
    reference_keys = list(model.state_dict())
    FP8FlowConverter(cfg, None).convert(model)
    assert is_converted(model.layers["1"].moe) and not is_converted(model.layers["2"].moe)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    assert list(model.state_dict()) == reference_keys
    tokens = torch.randint(0, 2048, (2, 32))
    with cpu.integer_histc():
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
    assert math.isfinite(loss.item())
    w1 = model.layers["1"].moe.experts.w1
    assert w1.grad is not None and torch.isfinite(w1.grad).all() and w1.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="already converted"):
        FP8FlowConverter(cfg, None).convert(model)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trainer_trains_both_configs_on_cpu(tmp_path: Path, corpus: Path, family: str) -> None:
    """torchtitan's Trainer, 2 steps of each TOML on the CPU: FP8 close to BF16 at both steps, the first update included.

    Not "the loss falls": the two steps read two different batches, so one update need not lower the second's loss
    (under torch 2.11's initialization BF16's own rose on two families, 7.95 -> 7.98). Learning over a run is
    test_demo's check."""
    flavor = [] if FAMILIES[family] is None else ["--model.flavor", FAMILIES[family]]
    add_qwen3_cpu_flavor()
    common = [*flavor,
        "--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--training.dataset_path", str(corpus.parent), "--training.mixed_precision_param", "float32",
        "--model.hf_assets_path", str(assets.TOKENIZER_DIR),
    ]  # fmt: skip
    losses = {
        name: cpu.train(["--job.config_file", str(toml), "--job.dump_folder", str(tmp_path / name), *common], False)
        for name, toml in zip(("bf16", "fp8flow"), pair(family), strict=True)
    }
    assert all(len(v) == 2 and all(map(math.isfinite, v)) for v in losses.values())
    for step in range(2):
        assert losses["fp8flow"][step] == pytest.approx(losses["bf16"][step], rel=1e-3)
    assert losses["fp8flow"] != losses["bf16"], "the fp8flow run must have run the FP8 path"
    assert not torch.distributed.is_initialized()  # the one-process group is torn down


def _debugmodel_args(corpus: Path, dump: Path, *flags: str) -> list[str]:
    return [
        "--job.config_file", str(pair("deepseek_v3_debug")[1]), "--training.steps", "2", "--training.seq_len", "64",
        "--training.local_batch_size", "2", "--training.dataset_path", str(corpus.parent),
        "--training.mixed_precision_param", "float32", "--model.hf_assets_path", str(assets.TOKENIZER_DIR),
        "--activation_checkpoint.selective_ac_option", "op", "--job.dump_folder", str(dump), *flags,
    ]  # fmt: skip


def test_parameter_parts_name_the_modules_a_spike_can_come_from() -> None:
    from fp8flow_ao.torchtitan.record import parameter_part

    assert parameter_part("layers.3.moe.experts.w1") == "layers.3.moe.experts"
    assert parameter_part("layers.3.moe.router.gate.weight") == "layers.3.moe.router"
    assert parameter_part("layers.0._checkpoint_wrapped_module.attention.wq.weight") == "layers.0.attention"
    assert parameter_part("layers.1.feed_forward.w1.weight") == "layers.1.feed_forward"
    assert parameter_part("_orig_mod.tok_embeddings.weight") == "tok_embeddings"
    assert parameter_part("norm.weight") == "norm" and parameter_part("bias") == "bias"


def test_part_norms_record_every_step_with_or_without_gradients() -> None:
    """A step without gradients still records (zeros): the series stay aligned with the steps, and under several
    ranks every rank joins the step's all-reduce."""
    from fp8flow_ao.torchtitan.record import _PartNorms

    model = torch.nn.ModuleDict({"norm": torch.nn.Linear(2, 2), "output": torch.nn.Linear(2, 3, bias=False)})
    series: dict[str, list[float]] = {}
    norms = _PartNorms([model], 1, series)
    norms(list(model.parameters()))
    model["output"].weight.grad = torch.full((3, 2), 2.0)
    norms(list(model.parameters()))
    norms.finish()
    assert series == {"norm": [0.0, 0.0], "output": [0.0, pytest.approx(math.sqrt(24))]}


def test_part_norms_add_up_to_the_clipped_norm(tmp_path: Path, corpus: Path) -> None:
    """One process: the recorded parts' gradient norms are torchtitan's pre-clip norm taken apart."""
    record = cpu.train_recorded_on_cpu(_debugmodel_args(corpus, tmp_path), False, grad_norm_parts=True)
    _check_part_norms(dataclasses.asdict(record), record.losses)


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> list[float]:
    """The FP8-Flow debugmodel, 2 steps, nothing compiled, no activation checkpointing (the AC test below
    checks that AC changes no loss)."""
    return cpu.train(_debugmodel_args(corpus, tmp_path_factory.mktemp("eager")), False)


@pytest.mark.parametrize(
    ("mode", "recompute"),
    [("selective", False), ("full", False), ("full", True)],
    ids=["selective-op", "full", "full-recompute"],
)
def test_trainer_with_activation_checkpointing_matches_no_checkpointing(
    tmp_path: Path, corpus: Path, eager_losses: list[float], mode: str, recompute: bool
) -> None:
    """torchtitan's AC around the converted blocks (per-op selective, full) and recompute_experts: same losses as none.

    Step 2's loss depends on step 1's gradients, so equal losses mean the recomputed forward in
    backward gave the same gradients on the FP8-Flow path (the CPU runs deterministic kernels).
    """
    flags = ["--activation_checkpoint.mode", mode] + (["--fp8flow.recompute_experts"] if recompute else [])
    checkpointed = cpu.train(_debugmodel_args(corpus, tmp_path / mode, *flags), False)
    assert len(checkpointed) == 2 and all(map(math.isfinite, checkpointed))
    assert checkpointed == eager_losses


@pytest.mark.parametrize(
    ("args", "backend"),
    [
        ((), None),  # "auto" without compile.enable
        (("--compile.enable",), "inductor"),
        (("--compile.enable", "--compile.backend", "aot_eager"), "aot_eager"),
        (("--compile.enable", "--compile.components", "loss"), None),  # torchtitan compiles no model part
        (("--compile.enable", "--fp8flow.compile_experts", "off"), None),
        (("--fp8flow.compile_experts", "on"), "inductor"),
    ],
)
def test_compile_experts_option_reaches_the_layers(args: tuple[str, ...], backend: str | None) -> None:
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    cfg = parse("--job.custom_config_module", "fp8flow_ao.torchtitan.job_config", *args)
    with torch.device("meta"):
        model = DeepSeekV3Model(debug_args())
    FP8FlowConverter(cfg, None).convert(model)
    layers = [m for m in model.modules() if isinstance(m, FP8FlowMoE)]
    assert layers and all(m.experts.fp8flow_compile_backend == backend for m in layers)


def test_compile_experts_refuses_bad_values_and_skips_expert_parallel() -> None:
    from torchtitan.distributed import ParallelDims

    cfg = parse("--job.custom_config_module", "fp8flow_ao.torchtitan.job_config", "--compile.enable")
    ep2 = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=2, etp=1, world_size=2)
    assert FP8FlowConverter(cfg, ep2).compile_backend is None, "expert parallelism runs the experts eagerly"
    cfg.fp8flow.compile_experts = "yes"
    with pytest.raises(ValueError, match='fp8flow.compile_experts must be "auto", "on" or "off"'):
        FP8FlowConverter(cfg, None)
    cfg.fp8flow.compile_experts = "on"
    with pytest.raises(ValueError, match="expert_parallel_degree > 1"):
        FP8FlowConverter(cfg, ep2)
    cfg.fp8flow.backward = "bf16_wgrad"
    with pytest.raises(ValueError, match='not supported with fp8flow.backward = "bf16_wgrad"'):
        FP8FlowConverter(cfg, None)
    cfg.fp8flow.backward = "fp8"
    cfg.fp8flow.recipe = "rowwise"
    with pytest.raises(ValueError, match='needs fp8flow.recipe = "blockwise"'):
        FP8FlowConverter(cfg, None)
    cfg.fp8flow.compile_experts = "auto"
    assert FP8FlowConverter(cfg, None).compile_backend is None


TT_ARGS = ("--job.custom_config_module", "fp8flow_ao.torchtitan.job_config")
# CUDA graphs need activation checkpointing off (torchtitan's default is "selective").
GRAPHED = ("--compile.enable", "--activation_checkpoint.mode", "none", "--fp8flow.compile_mode", "reduce-overhead")


def parallel_dims(**degrees: int):
    """A torchtitan ``ParallelDims`` with the given degrees, every other one 1 (no mesh is built)."""
    from torchtitan.distributed import ParallelDims

    dims = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, "etp": 1} | degrees
    world_size = math.prod(dims[d] for d in ("dp_replicate", "dp_shard", "cp", "tp", "pp"))
    return ParallelDims(**dims, world_size=world_size)


@pytest.mark.parametrize(
    ("args", "mode"),
    [
        (("--compile.enable",), None),  # "default": torch.compile's own default mode
        (GRAPHED, "reduce-overhead"),
        ((*GRAPHED, "--fp8flow.weight_cache", "forward", "--fp8flow.backward", "bf16_fc1_dgrad"), "reduce-overhead"),
    ],
)
def test_compile_mode_option_reaches_the_layers(args: tuple[str, ...], mode: str | None) -> None:
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    with torch.device("meta"):
        model = DeepSeekV3Model(debug_args())
    FP8FlowConverter(parse(*TT_ARGS, *args), None).convert(model)
    layers = [m for m in model.modules() if isinstance(m, FP8FlowMoE)]
    assert layers and all(m.experts.fp8flow_compile_mode == mode for m in layers)
    assert all(m.experts.fp8flow_compile_backend == "inductor" for m in layers)


def test_compile_mode_parses_from_toml(tmp_path: Path) -> None:
    toml = tmp_path / "graphed.toml"
    toml.write_text(
        '[job]\ncustom_config_module = "fp8flow_ao.torchtitan.job_config"\n'
        '[fp8flow]\ncompile_mode = "reduce-overhead"\n'
    )
    assert parse("--job.config_file", str(toml)).fp8flow.compile_mode == "reduce-overhead"


def test_compile_mode_takes_the_step_cache() -> None:
    """CUDA graphs with ``weight_cache = "step"``: the cache keeps its tiles at fixed addresses for them, so
    the hook after an optimizer step marks them stale instead of dropping them."""
    from fp8flow_ao.weight_cache import EXPERT_WEIGHT_CACHE

    converter = FP8FlowConverter(parse(*TT_ARGS, *GRAPHED, "--fp8flow.weight_cache", "step"), None)
    assert converter.compile_mode == "reduce-overhead"
    EXPERT_WEIGHT_CACHE.invalidate()  # entries of earlier tests' models that are still alive
    w = torch.nn.Parameter(torch.randn(128, 128))
    tiles = EXPERT_WEIGHT_CACHE.get((w,), w.detach().clone)
    try:
        converter.post_optimizer_hook(torch.nn.Module())
        assert len(EXPERT_WEIGHT_CACHE) == 1
        assert EXPERT_WEIGHT_CACHE.get((w,), w.detach().clone, lambda old: old.copy_(w.detach())) is tiles
    finally:
        EXPERT_WEIGHT_CACHE.invalidate()


def test_compile_mode_allows_replicated_data_parallel() -> None:
    """DDP keeps every weight where it is, so CUDA graphs' fixed addresses hold (unlike FSDP2's unsharding)."""
    converter = FP8FlowConverter(parse(*TT_ARGS, *GRAPHED), parallel_dims(dp_replicate=2))
    assert converter.compile_mode == "reduce-overhead"


@pytest.mark.parametrize(
    ("args", "dims", "match"),
    [
        (("--compile.enable", "--fp8flow.compile_experts", "off"), {}, 'compile_experts = "off"'),
        ((), {}, 'compile_experts = "auto" while torchtitan does not compile'),
        (("--compile.enable", "--compile.components", "loss"), {}, 'compile_experts = "auto" while torchtitan'),
        (("--compile.enable",), {"ep": 2}, r"expert_parallel_degree > 1"),
        (("--compile.enable", "--fp8flow.recipe", "rowwise"), {}, 'fp8flow.recipe = "rowwise"'),
        (("--compile.enable", "--fp8flow.backward", "bf16"), {}, r'fp8flow.backward = "bf16" \(an ablation'),
        (("--compile.enable", "--fp8flow.backward", "bf16_wgrad"), {}, 'fp8flow.backward = "bf16_wgrad"'),
        (("--compile.enable", "--compile.backend", "aot_eager"), {}, 'needs compile.backend = "inductor"'),
        (("--compile.enable",), {"dp_shard": 2}, "under FSDP.*not been measured"),
        (("--compile.enable",), {"cp": 2}, "under FSDP.*not been measured"),
        (("--compile.enable",), {"dp_replicate": 2, "dp_shard": 2}, "under FSDP"),  # HSDP
        (("--compile.enable", "--activation_checkpoint.mode", "full"), {}, 'activation_checkpoint.mode = "none"'),
        (("--compile.enable", "--activation_checkpoint.mode", "selective"), {}, "activation_checkpoint"),
        (("--compile.enable",), {"pp": 2}, "pipeline parallelism"),
    ],
    ids=[
        "off",
        "auto-no-compile",
        "auto-loss-only",
        "ep",
        "rowwise",
        "bf16",
        "bf16_wgrad",
        "aot_eager",
        "fsdp",
        "cp",
        "hsdp",
        "full-ac",
        "selective-ac",
        "pp",
    ],
)
def test_compile_mode_refuses_what_it_cannot_apply(args: tuple[str, ...], dims: dict[str, int], match: str) -> None:
    """Each setting under which "reduce-overhead" would do nothing or is unmeasured: a ValueError at conversion."""
    cfg = parse(*TT_ARGS, "--activation_checkpoint.mode", "none", *args, "--fp8flow.compile_mode", "reduce-overhead")
    world = parallel_dims(**dims) if dims else None
    with pytest.raises(ValueError, match=r'fp8flow\.compile_mode = "reduce-overhead".*' + match):
        FP8FlowConverter(cfg, world)


def test_compile_mode_refuses_unknown_values() -> None:
    cfg = parse(*TT_ARGS, "--compile.enable")
    cfg.fp8flow.compile_mode = "max-autotune"
    with pytest.raises(ValueError, match='fp8flow.compile_mode must be "default" or "reduce-overhead"'):
        FP8FlowConverter(cfg, None)


@pytest.fixture
def torchtitan_compile_globals(monkeypatch: pytest.MonkeyPatch):
    """Undo what torchtitan's ``apply_compile`` changes for the whole process (its BF16 experts' function
    compiled, dynamo's ``capture_scalar_outputs``), and start and end with empty dynamo caches."""
    from torchtitan.models.moe import moe as moe_module

    monkeypatch.setattr(moe_module, "_run_experts_grouped_mm", moe_module._run_experts_grouped_mm)
    torch._dynamo.reset()
    # The config's own patch, not monkeypatch: pytest 9.2's undo deletes an attribute that was not in the
    # module's __dict__, which hides the config entry for every later test ("... does not exist").
    with torch._dynamo.config.patch(capture_scalar_outputs=torch._dynamo.config.capture_scalar_outputs):
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("mode", "recompute"),
    [("none", False), ("selective", False), ("full", True)],
    ids=["no-ac", "selective-op", "full-recompute"],
)
def test_trainer_with_compiled_experts_matches_eager(
    tmp_path: Path, corpus: Path, eager_losses: list[float], torchtitan_compile_globals, mode: str, recompute: bool
) -> None:
    """torchtitan compiles the model (``compile.enable``) and, by default, the converter the FP8-Flow routed
    experts, inside torchtitan's AC wrappers: the same losses as eager. ``aot_eager`` runs dynamo, AOT
    autograd and the compiled backward without inductor's CPU code generation (slow here; it rounds
    torchtitan's own compiled norms and attention differently, not the experts, whose ops are custom ops).
    Equal to 1e-6 relative, not bit for bit: the compiled backward may add a tensor's gradient contributions
    in another order (torch 2.11 on a 16-core machine: step 2 differed by 6e-8 with full AC + recompute)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    flags = ["--compile.enable", "--compile.backend", "aot_eager", "--activation_checkpoint.mode", mode]
    flags += ["--fp8flow.recompute_experts"] if recompute else []
    compiled = cpu.train(_debugmodel_args(corpus, tmp_path, *flags), False)
    assert _debug_get_cache_entry_list(_routed_experts.__code__), "the routed experts were compiled"
    assert compiled == pytest.approx(eager_losses, rel=1e-6, abs=0)


def _torchrun_cpu_losses(
    config: Path, dump: Path, corpus: Path, *flags: str, record: Path | None = None
) -> list[float]:
    """Two CPU processes under ``torchrun`` (gloo), as a user launches torchtitan: the logged losses (``record``:
    rank 0 also writes the run's record there, every part's gradient norm included)."""
    import re
    import subprocess
    import sys

    recorded = [] if record is None else ["--record", str(record)]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(cpu.free_port()),
        "-m", "fp8flow_ao.torchtitan.cpu", *recorded,
        "--job.config_file", str(config), "--job.dump_folder", str(dump),
        "--training.steps", "3", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--training.mixed_precision_param", "float32", "--training.dataset_path", str(corpus.parent),
        "--model.hf_assets_path", str(assets.TOKENIZER_DIR), *flags,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    assert proc.returncode == 0, log[-4000:]
    return [
        float(v) for _, v in sorted(set(re.findall(r"step:\s+(\d+)\s+loss:\s+([\d.]+)", log)), key=lambda t: int(t[0]))
    ]


def _check_part_norms(record: dict, losses: list[float]) -> None:
    """A record with every part's gradient norm: over the ranks' shards (EP's experts, FSDP2's shards of the rest),
    the parts' squares add up to the norm torchtitan clipped by, every step; every expert weight has a gradient."""
    parts = record["grad_norm_parts"]
    assert record["losses"] == pytest.approx(losses, abs=1e-5)  # the log prints 5 decimals
    assert all(m >= v for m, v in zip(record["max_losses"], record["losses"], strict=True))
    experts = [name for name in parts if name.endswith(".moe.experts")]
    assert experts and "tok_embeddings" in parts and "output" in parts, sorted(parts)
    for step, total in enumerate(record["grad_norms"]):
        assert math.sqrt(sum(norms[step] ** 2 for norms in parts.values())) == pytest.approx(total, rel=1e-5)
        assert all(parts[name][step] > 0 for name in experts)


def test_expert_parallel_under_torchrun_trains_like_bf16(tmp_path: Path, corpus: Path) -> None:
    """The shipped TOMLs with torchtitan's own ``expert_parallel_degree 2`` (x FSDP2 over the same 2
    ranks), launched by torchrun on 2 gloo processes: FP8-Flow (FP8 dispatch) trains and tracks BF16."""
    flags = ("--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2")
    bf16_toml, fp8_toml = pair("deepseek_v3_debug")
    bf16 = _torchrun_cpu_losses(bf16_toml, tmp_path / "bf16", corpus, *flags)
    fp8 = _torchrun_cpu_losses(fp8_toml, tmp_path / "fp8flow", corpus, *flags, record=tmp_path / "fp8flow.json")
    assert len(bf16) == len(fp8) == 3 and fp8[-1] < fp8[0]
    assert all(abs(f - b) <= 0.01 * b for f, b in zip(fp8, bf16, strict=True)), (fp8, bf16)
    _check_part_norms(json.loads((tmp_path / "fp8flow.json").read_text()), fp8)
    # The expert weights all-gathered as FP8 tiles, and checkpointed: there the experts' shard mesh has one rank
    # (EP = the shard degree), where FSDP2 gathers nothing; this launch once stopped at its first forward, and
    # its checkpoints held a tensor subclass no loader accepted. The same tiles: the same losses as printed.
    gather = ("--fp8flow.fsdp_fp8_all_gather", "--checkpoint.enable", "--checkpoint.interval", "2")
    gathered = _torchrun_cpu_losses(fp8_toml, tmp_path / "fp8gather", corpus, *flags, *gather)
    assert gathered == fp8, (gathered, fp8)
    assert (tmp_path / "fp8gather" / "checkpoint" / "step-2").is_dir()


@pytest.mark.gpu
@pytest.mark.parametrize("weight_cache", ["off", "step"])
def test_trainer_with_cuda_graph_experts_matches_the_compiled_path(
    tmp_path: Path, corpus: Path, torchtitan_compile_globals, weight_cache: str
) -> None:
    """``fp8flow.compile_mode = "reduce-overhead"``: the routed experts replay as CUDA graphs (recorded by
    inductor's CUDA graph trees), with the same losses as the default compiled path. (Under activation
    checkpointing the converter refuses the mode: on the H200 the recomputed forward's replay overwrote
    outputs its backward still read, and torch raised.) With ``weight_cache = "step"`` the graphs read the
    cached tiles in place, which the cache re-quantizes after every optimizer step: nothing is recorded again."""
    import sys

    from torch._inductor import cudagraph_trees

    sys.path.insert(0, str(REPO / "benchmarks"))
    from _torchtitan import train  # the benchmarks' in-process one-GPU run

    flags = ["--compile.enable", "--activation_checkpoint.mode", "none", "--training.steps", "4"]
    flags += ["--fp8flow.weight_cache", weight_cache]
    default = train(_debugmodel_args(corpus, tmp_path / "default", *flags), "cuda").losses
    torch._dynamo.reset()
    graphs = train(
        _debugmodel_args(corpus, tmp_path / "graphs", *flags, "--fp8flow.compile_mode", "reduce-overhead"), "cuda"
    ).losses
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None
    assert len(graphs) == 4 and all(math.isfinite(x) for x in graphs)
    assert graphs == pytest.approx(default, rel=1e-6, abs=0)
    if weight_cache == "step":
        assert sum(sum(counts.values()) for counts in manager.num_rerecord.values()) == 0

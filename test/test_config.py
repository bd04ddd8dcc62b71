"""FP8FlowConfig with torchao's quantize_: what gets converted, the filters, clear errors, checkpoints
that load both ways, the row-wise comparison recipe, and fp32 models."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from conftest import DEVICE
from fp8_helpers import sqnr_db
from test_moe import PARAMS, _inputs, make_moe, run_step
from torch import nn
from torchao.quantization import quantize_

from fp8flow_ao.config import FP8FlowConfig, convert_to_fp8flow
from fp8flow_ao.debug import FP8FlowOpCounter
from fp8flow_ao.moe import FP8FlowGroupedExperts, FP8FlowMoE, convert_moe_layer, is_moe_layer
from fp8flow_ao.tensor import FP8FlowExpertWeight
from fp8flow_ao.torchtitan.cpu import integer_histc

moe_mod = pytest.importorskip("torchtitan.models.moe.moe")


class _Block(nn.Module):
    def __init__(self, **moe_kwargs):
        super().__init__()
        self.attention = nn.Linear(moe_kwargs.get("dim", 256), moe_kwargs.get("dim", 256), bias=False, device=DEVICE)
        self.moe = make_moe(**moe_kwargs)

    def forward(self, x):
        return self.moe(self.attention(x))


class _Model(nn.Module):
    """Two transformer-ish blocks, each a Linear and a torchtitan MoE layer."""

    def __init__(self, **moe_kwargs):
        super().__init__()
        self.layers = nn.ModuleList([_Block(**moe_kwargs, seed=i) for i in range(2)])
        self.to(torch.bfloat16)
        for block in self.layers:  # routing state stays fp32, as torchtitan keeps it
            block.moe.expert_bias, block.moe.tokens_per_expert = (
                t.float() for t in (block.moe.expert_bias, block.moe.tokens_per_expert)
            )

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with integer_histc(), torch.no_grad():
        return model(x)


def test_config_fields_and_validation():
    config = FP8FlowConfig()
    assert (config.recompute_experts, config.recipe, config.module_filter) == (False, "blockwise", None)
    with pytest.raises(ValueError, match="recipe must be one of"):
        FP8FlowConfig(recipe="tensorwise")
    with pytest.raises(TypeError, match="recompute_experts must be a bool"):
        FP8FlowConfig(recompute_experts="yes")
    with pytest.raises(ValueError, match="recompute_experts=True needs recipe='blockwise'"):
        FP8FlowConfig(recompute_experts=True, recipe="rowwise")
    with pytest.raises(TypeError, match="module_filter must be callable"):
        FP8FlowConfig(module_filter="layers.0.moe")
    assert FP8FlowConfig().weight_cache == "off"  # no FP8 weight copy outlives a GEMM unless asked for
    assert FP8FlowConfig().backward == "fp8"
    with pytest.raises(ValueError, match="backward must be one of"):
        FP8FlowConfig(backward="fp32")
    with pytest.raises(ValueError, match="needs recompute_experts=False"):
        FP8FlowConfig(backward="bf16", recompute_experts=True)
    with pytest.raises(ValueError, match="needs recipe='blockwise'"):
        FP8FlowConfig(backward="bf16", recipe="rowwise")
    # FC1's dgrad in BF16 is a training mode: with recompute (and expert parallelism) as FP8-Flow is
    assert FP8FlowConfig(backward="bf16_fc1_dgrad", recompute_experts=True).backward == "bf16_fc1_dgrad"
    with pytest.raises(ValueError, match="does not gather"):  # FSDP's FP8 all-gather leaves no BF16 weights
        FP8FlowConfig(backward="bf16_fc1_dgrad", fsdp_fp8_all_gather=True)
    with pytest.raises(TypeError, match="config must be an FP8FlowConfig or None, got dict"):
        convert_to_fp8flow(make_moe(), {"recompute_experts": True})
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        convert_to_fp8flow("model", FP8FlowConfig())


def test_backward_ablation_reaches_the_experts():
    model = _Model()
    quantize_(model, FP8FlowConfig(backward="bf16"))
    assert all(block.moe.experts.fp8flow_backward == "bf16" for block in model.layers)


def test_weight_cache_reaches_the_experts():
    model = _Model()
    quantize_(model, FP8FlowConfig(weight_cache="forward"))
    assert all(block.moe.experts.fp8flow_weight_cache == "forward" for block in model.layers)


def test_plain_quantize_call_converts_every_moe_layer():
    model = _Model()
    quantize_(model, FP8FlowConfig(recompute_experts=True))
    for block in model.layers:
        assert isinstance(block.moe, FP8FlowMoE) and isinstance(block.moe, moe_mod.MoE)
        assert isinstance(block.moe.experts, FP8FlowGroupedExperts) and block.moe.experts.fp8flow_recompute_experts
        assert type(block.attention) is nn.Linear and type(block.moe.router.gate) is nn.Linear
        assert all(type(p) is nn.Parameter for p in block.parameters())
    x = torch.randn(2, 32, 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    with integer_histc(), FP8FlowOpCounter() as counter:
        model(x).float().square().sum().backward()
    assert counter.activation_casts == 2 * len(model.layers)  # one forward, one backward cast per layer
    with pytest.raises(ValueError, match="already converted"):
        quantize_(model, FP8FlowConfig())


def test_second_quantize_call_raises_with_the_same_config_too():
    """One quantize_ call converts once (its handler runs per nn.Linear); a second call with the very same
    config object is a second conversion, refused as one with a new config is, not silently skipped."""
    config = FP8FlowConfig()
    model = _Model()
    quantize_(model, config)
    with pytest.raises(ValueError, match="already converted"):
        quantize_(model, config)
    other = _Model()  # the same config converts another model
    quantize_(other, config)
    assert all(isinstance(block.moe, FP8FlowMoE) for block in other.layers)


def test_module_filter_and_filter_fn():
    seen = []

    def only_second(module, fqn):
        seen.append((type(module).__name__, fqn))
        return fqn == "layers.1.moe"

    model = _Model()
    quantize_(model, FP8FlowConfig(module_filter=only_second))
    assert seen == [("MoE", "layers.0.moe"), ("MoE", "layers.1.moe")]  # called on MoE layers only
    assert not isinstance(model.layers[0].moe, FP8FlowMoE) and isinstance(model.layers[1].moe, FP8FlowMoE)
    # torchao's own filter_fn reaching the MoE layers directly works too, and chooses the layers
    model = _Model()
    quantize_(model, FP8FlowConfig(), filter_fn=is_moe_layer)
    assert all(isinstance(block.moe, FP8FlowMoE) for block in model.layers)
    model = _Model()
    quantize_(model, FP8FlowConfig(), filter_fn=lambda m, fqn: is_moe_layer(m) and fqn == "layers.0.moe")
    assert isinstance(model.layers[0].moe, FP8FlowMoE) and not isinstance(model.layers[1].moe, FP8FlowMoE)
    with pytest.raises(ValueError, match="none accepted by module_filter"):
        quantize_(_Model(), FP8FlowConfig(module_filter=lambda m, fqn: False), filter_fn=is_moe_layer)


@pytest.mark.parametrize("filter_fn", [None, is_moe_layer], ids=["default_filter", "filter_fn_is_moe_layer"])
def test_one_bad_layer_leaves_every_layer_unconverted(filter_fn):
    """Every layer is checked before any is converted, whichever filter hands quantize_'s handler its modules."""
    model = _Model()
    model.layers[1] = _Block(hidden=192, seed=1).to(torch.bfloat16)
    with pytest.raises(ValueError, match="layers.1.moe.*multiples of 128.*H=192"):
        quantize_(model, FP8FlowConfig(), **({} if filter_fn is None else {"filter_fn": filter_fn}))
    assert not any(isinstance(m, FP8FlowMoE) for m in model.modules())


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: nn.Sequential(nn.Linear(256, 256)), "no MoE layer"),
        (lambda: _Model(hidden=192), "multiples of 128.*D=256, H=192"),
        (lambda: _Model(dim=320), "multiples of 128.*D=320"),
        (lambda: _Model().half(), r"runs in \(torch.bfloat16, torch.float32\).*torch.float16"),
    ],
)
def test_unsupported_models_raise_and_stay_untouched(build, match):
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        quantize_(model, FP8FlowConfig())
    assert not any(isinstance(m, FP8FlowMoE) for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="none accepted by module_filter"):
        convert_to_fp8flow(_Model(), FP8FlowConfig(module_filter=lambda m, fqn: False))


def _gpt_oss(flavor: str) -> nn.Module:
    """torchtitan 0.2.2's gpt-oss model of ``flavor`` with 2 layers, on the meta device (no memory)."""
    import dataclasses

    from torchtitan.models.gpt_oss import GptOssModel, gptoss_configs

    with torch.device("meta"):
        return GptOssModel(dataclasses.replace(gptoss_configs[flavor], n_layers=2))


@pytest.mark.parametrize("flavor", ["debugmodel", "20b"])
def test_gpt_oss_is_refused_with_what_it_needs(flavor):
    model = _gpt_oss(flavor)
    with pytest.raises(ValueError, match="gpt-oss experts") as err:
        quantize_(model, FP8FlowConfig())
    message = str(err.value)
    assert "'layers.0.moe'" in message and "2 MoE layer(s)" in message
    assert "mlp1_bias, mlp2_bias" in message and "interleaved clamped SwiGLU" in message
    assert "swiglu_limit=7.0" in message
    # both flavors' expert H is 2880 (the debug flavor keeps the default moe_inter_dim); only 20b's D is
    assert "H=2880" in message and ("D=2880" in message) == (flavor == "20b")
    assert not any(isinstance(m, FP8FlowMoE) for m in model.modules())


def test_score_before_experts_layers_are_converted():
    """Llama 4's score placement (torchtitan's default MoEArgs) converts: the score goes into SwiGLU's inputs."""
    model = _Model(score_before_experts=True)
    quantize_(model, FP8FlowConfig())
    assert all(block.moe.experts.fp8flow_score_before_experts for block in model.layers)


def test_checkpoints_load_both_ways():
    plain = _Model()
    converted = copy.deepcopy(plain)
    quantize_(converted, FP8FlowConfig())
    x = torch.randn(2, 32, 256, device=DEVICE, dtype=torch.bfloat16)
    expected = _forward(converted, x)
    state = converted.state_dict()
    assert list(state) == list(plain.state_dict())
    assert all(type(v) is torch.Tensor for v in state.values())
    # converted -> unconverted
    fresh = _Model()
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), plain.state_dict().values(), strict=True))
    # unconverted -> converted: same weights, same FP8 output
    other = _Model()
    quantize_(other, FP8FlowConfig())
    other.load_state_dict(fresh.state_dict())
    assert torch.equal(_forward(other, x), expected)


def test_converted_model_pickles():
    """torch.save(model) / pickle of a converted model: its classes are made at run time, so pickle gets what
    they are made from; the loaded model is converted with the same options and gives the same bits."""
    model = _Model()
    quantize_(model, FP8FlowConfig(recompute_experts=True))
    x = torch.randn(2, 32, 256, device=DEVICE, dtype=torch.bfloat16)
    expected = _forward(model, x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for loaded in (pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)):
        assert [type(m) for m in loaded.modules()] == [type(m) for m in model.modules()]
        assert all(block.moe.experts.fp8flow_recompute_experts for block in loaded.layers)
        assert torch.equal(_forward(loaded, x), expected)


@pytest.mark.parametrize("option", ["recompute_experts", "fsdp_fp8_all_gather"])
def test_convert_moe_layer_takes_bools_only(option):
    moe = make_moe()
    with pytest.raises(TypeError, match=f"{option} must be a bool"):
        convert_moe_layer(moe, **{option: "no"})
    assert not isinstance(moe, FP8FlowMoE)


def test_fp32_model_keeps_its_dtypes():
    moe = make_moe(dtype=torch.float32)
    convert_to_fp8flow(moe)
    x, grad = _inputs(256, 128)
    result = run_step(moe, x.float(), grad.float())
    assert all(result[k].dtype == torch.float32 for k in ("out", "x", *PARAMS))


def test_rowwise_recipe_on_cpu_needs_torchtitans_cpu_padding(monkeypatch):
    """torchtitan pads the row-wise recipe's expert groups with a Triton kernel: on the CPU without Triton's
    interpreter a clear error names the ways out (it once stopped in Triton's driver lookup); inside
    ``torchtitan_on_cpu()`` (torchtitan's ``use_cpu=True``) the layer runs."""
    from torchtitan.models.moe import utils as moe_utils

    from fp8flow_ao.torchtitan.cpu import torchtitan_on_cpu

    monkeypatch.setattr(moe_utils, "TOKEN_GROUP_ALIGN_SIZE_M", moe_utils.TOKEN_GROUP_ALIGN_SIZE_M)
    moe = make_moe(experts=4, top_k=2).cpu()
    quantize_(moe, FP8FlowConfig(recipe="rowwise"))
    x, _ = _inputs(256, 128)
    x = x.cpu()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with integer_histc(), pytest.raises(ValueError, match="token padding .* is a Triton kernel with no CPU backend"):
        moe(x)
    with torchtitan_on_cpu():
        assert moe(x).shape == x.shape


def test_rowwise_recipe_matches_bf16_layer(monkeypatch):
    from torchtitan.models.moe import utils as moe_utils

    monkeypatch.setattr(moe_utils, "TOKEN_GROUP_ALIGN_SIZE_M", moe_utils.TOKEN_GROUP_ALIGN_SIZE_M)
    ref = make_moe(experts=4, top_k=2)
    moe = copy.deepcopy(ref)
    quantize_(moe, FP8FlowConfig(recipe="rowwise"))
    assert moe_utils.TOKEN_GROUP_ALIGN_SIZE_M == 128 and type(moe) is moe_mod.MoE
    assert all(isinstance(getattr(moe.experts, n), FP8FlowExpertWeight) for n in ("w1", "w2", "w3"))
    assert all(type(v) is torch.Tensor for v in moe.state_dict().values())
    with pytest.raises(ValueError, match="already converted"):
        quantize_(moe, FP8FlowConfig())
    assert all(getattr(moe.experts, n).offs_aligned for n in ("w1", "w2", "w3"))
    x, grad = _inputs(256, 128)
    expected = run_step(ref, x, grad)
    with FP8FlowOpCounter() as counter:
        result = run_step(moe, x, grad)
    # torchtitan padded the groups to 128 rows: the FP8 op must not pad them again.
    assert counter.counts["route_pad"] == 0 and counter.counts["permute_pad_rows"] == 0
    assert sqnr_db(expected["out"], result["out"]) >= 25
    for key in ("x", *PARAMS):
        assert sqnr_db(expected[key], result[key]) >= 22, key

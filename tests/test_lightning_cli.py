"""lazytrain-cli (LightningCLI over CausalLMModule + StdlibTextDataModule): fit with fast_dev_run in-process via
``build_cli(args=[...])``, the strategy by registered name and by class_path; the model from the command line."""

from __future__ import annotations

import sys

import pytest

from lightning_lazytrain.cli.lightning_cli import build_cli
from lightning_lazytrain.lit_module import CausalLMModule

try:
    from lightning_lazytrain.strategy import LazyTrainStrategy
except ImportError as err:  # pragma: no cover - the strategy ships with the package
    LazyTrainStrategy = None
    _WHY = f"lightning_lazytrain.strategy cannot be imported: {err}"
else:
    _WHY = ""
needs_strategy = pytest.mark.skipif(LazyTrainStrategy is None, reason=_WHY or "strategy present")

DATA = ["--data.max_bytes=300000", "--data.holdout_every=5", "--data.seq_len=32", "--data.batch_size=2",
        "--data.val_windows=4"]


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    """LightningCLI warns when pytest's own argv is present besides ``args``."""
    monkeypatch.setattr(sys, "argv", ["lazytrain-cli"])


def fit_args(tmp_path, *extra: str) -> list[str]:
    return ["fit", "--trainer.fast_dev_run=2", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={tmp_path}", *DATA, *extra]


def test_parse_model_from_the_command_line(tmp_path):
    cli = build_cli(["--model.model_name=tiny",
                     "--model.model_overrides={num_layers: 2, hidden: 32, intermediate: 88}", "--model.lr=0.01",
                     "--model.optimizer=hybrid_adamw", "--trainer.accelerator=cpu",
                     f"--trainer.default_root_dir={tmp_path}", *DATA], run=False)
    module = cli.model
    assert isinstance(module, CausalLMModule) and module.model_kind == "llama"
    assert (module.model_spec.num_layers, module.model_spec.hidden) == (2, 32) and module.model_spec.vocab == 256
    assert len(module.model.layers) == 2 and module.lr == 0.01
    assert cli.datamodule.seq_len == 32


def test_unknown_model_name_is_clear(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'nope'.*tiny"):
        build_cli(["--model.model_name=nope", f"--trainer.default_root_dir={tmp_path}"], run=False)


def test_fit_with_strategy_auto(tmp_path):
    cli = build_cli(fit_args(tmp_path, "--trainer.strategy=auto"))
    assert cli.trainer.state.finished and cli.trainer.global_step == 2
    assert float(cli.trainer.callback_metrics["train_loss"]) > 0


@needs_strategy
def test_fit_with_strategy_by_name(tmp_path):
    cli = build_cli(fit_args(tmp_path, "--trainer.strategy=lazytrain"))
    assert isinstance(cli.trainer.strategy, LazyTrainStrategy)
    assert cli.trainer.state.finished and cli.trainer.global_step == 2
    assert "val_loss" in cli.trainer.callback_metrics


@needs_strategy
def test_fit_with_strategy_by_class_path(tmp_path):
    cli = build_cli(fit_args(tmp_path,
                             "--trainer.strategy.class_path=lightning_lazytrain.strategy.LazyTrainStrategy",
                             "--trainer.strategy.init_args.hardware=cpu",
                             "--trainer.strategy.init_args.policy=megatrain", "--model.optimizer=hybrid_adamw"))
    strategy = cli.trainer.strategy
    assert isinstance(strategy, LazyTrainStrategy) and strategy.policy == "megatrain" and strategy.hardware == "cpu"
    assert cli.trainer.state.finished and cli.trainer.global_step == 2


def test_hugging_face_model_from_a_config_dict(tmp_path):
    pytest.importorskip("transformers")
    cli = build_cli(["--model.hf_config={model_type: llama, vocab_size: 256, hidden_size: 32, "
                     "intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 1}",
                     f"--trainer.default_root_dir={tmp_path}", *DATA], run=False)
    module = cli.model
    assert module.model_kind == "hf" and type(module.model).__name__ == "LlamaForCausalLM"
    assert len(module.model.model.layers) == 2
    batch = next(iter(_loader(cli.datamodule)))
    assert 5.0 < module._nll(batch).item() < 6.5  # ~ln 256 untrained


def _loader(dm):
    dm.setup("fit")
    return dm.train_dataloader()


@needs_strategy
@pytest.mark.parametrize("subcommand", ["test", "predict"])
def test_test_and_predict_subcommands(tmp_path, subcommand):
    cli = build_cli([subcommand, "--trainer.fast_dev_run=1", "--trainer.accelerator=cpu",
                     "--trainer.strategy=lazytrain", "--trainer.enable_progress_bar=false",
                     f"--trainer.default_root_dir={tmp_path}", *DATA])
    assert cli.trainer.state.finished
    if subcommand == "test":
        assert 5.0 < float(cli.trainer.callback_metrics["test_loss"]) < 6.5  # untrained: ~ln 256
    else:
        (out,) = cli.trainer.predict_loop.predictions
        assert out["nll"].shape == (2,) and out["next_token"].shape == (2, 32)

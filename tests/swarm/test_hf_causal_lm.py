"""A real swarm training a `transformers` model (--task hf-causal-lm) on local text files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="hf-causal-lm needs the hf extra: pip install -e '.[hf]'")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from peer.tasks import load_task  # noqa: E402
from peer.tasks.options import TaskOptions  # noqa: E402
from peer.testing import Swarm, max_parameter_difference  # noqa: E402
from tests.unit.test_hf_causal_lm import tiny_config, write_corpus  # noqa: E402


@pytest.mark.timeout(180)
async def test_two_peers_train_a_tiny_llama_on_local_text_files_and_export_it(tmp_path: Path):
    """Two peers, one tiny Llama configuration (a config.json), a few text files: the held-out loss falls and
    both end with one set of weights; `peer export` then writes what from_pretrained loads, with the peer's
    logits."""
    corpus = write_corpus(tmp_path / "corpus", files=3, paragraphs=150)
    config = tiny_config(tmp_path / "tiny-llama", hidden_size=48, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=4)
    epochs = 6
    async with Swarm(tmp_path, "--task", "hf-causal-lm", "--model-config", str(config / "config.json"),
                     "--data", str(corpus), "--seq-len", "64", "--batch-size", "8", "--target-batch-size", "32",
                     "--min-peers", "2", "--max-epochs", str(epochs), fast=True) as swarm:
        first, second = await swarm.start(2)
        assert await swarm.all_exited(timeout=120) == [0, 0]
        for peer in (first, second):
            summary = json.loads((tmp_path / f"{peer.name}.json").read_text())
            assert summary["exit_reason"] == "max_epochs" and summary["task"] == "hf-causal-lm"
            assert summary["val_loss_last"] <= 0.8 * summary["val_loss_first"], summary  # 5.52 to 3.93 here
        assert max_parameter_difference(first.model_state(), second.model_state()) <= 1e-5

        out = tmp_path / "exported"
        export = swarm.run("export", "--checkpoint-dir", str(first.checkpoint_dir), "--out", str(out), name="export")
        assert await export.exit_code(timeout=60) == 0, export.log_tail(2000)

    options = TaskOptions(model=str(config / "config.json"), data=corpus, seq_len=64)
    peers_model = load_task("hf-causal-lm", options=options).build_model()
    peers_model.load_state_dict(first.model_state())
    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    batch = torch.tensor([tokenizer("the swarm trains one model together.")["input_ids"]])
    with torch.no_grad():
        difference = (exported.eval()(batch).logits - peers_model.eval()(batch).logits).abs().max()
    assert float(difference) <= 1e-5

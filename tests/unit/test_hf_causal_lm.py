"""hf-causal-lm: the split and packing every peer agrees on, the tokenizer and its fit to the model, the model's
digest and seeding, export, and bad input as one line (nothing here reaches the network)."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers", reason="hf-causal-lm needs the hf extra: pip install -e '.[hf]'")

from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig  # noqa: E402

from peer.config import load_config  # noqa: E402
from peer.runtime.precision import MixedPrecision  # noqa: E402
from peer.runtime.resume import training_state  # noqa: E402
from peer.task_options import BUILTIN_MODEL_CONFIGS, TaskOptions  # noqa: E402
from peer.tasks import TaskLoadError, load_task  # noqa: E402
from peer.tasks.hf_models import NAMED_CONFIGS, config_digest, load_model_config  # noqa: E402
from peer.tasks.hf_text import (  # noqa: E402
    VAL_FRACTION,
    PackedSequences,
    is_validation_document,
    read_documents,
    tokenize_splits,
)
from peer.tasks.hf_tokenizer import byte_level_tokenizer, check_vocabulary, encode, load_tokenizer  # noqa: E402
from peer.telemetry.summary import PeerSummary  # noqa: E402
from tests.peers import REPO_ROOT  # noqa: E402

WORDS = "the swarm trains one model while peers join and leave at any time and average what they learn".split()


def write_corpus(directory: Path, files: int = 3, paragraphs: int = 120, seed: int = 0) -> Path:
    """Text files of made-up paragraphs (documents), separated by blank lines."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(files):
        text = "\n\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30))) + "."
                           for _ in range(paragraphs))
        (directory / f"part-{index}.txt").write_text(text + "\n")
    return directory


def tiny_config(directory: Path, **overrides) -> Path:
    """A save_pretrained directory of a tiny byte-level Llama configuration."""
    settings = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None)
    LlamaConfig(**{**settings, **overrides}).save_pretrained(directory)
    return directory


def one_line(error: BaseException) -> str:
    lines = str(error).splitlines()
    assert len(lines) == 1, str(error)
    return lines[0]


# ------------------------------------------------------------------------------------- data: split, packing


def test_the_split_is_a_function_of_each_documents_text_alone(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    files = sorted(str(path) for path in corpus.glob("*.txt"))
    documents = list(read_documents(files, "text"))
    assert len(documents) == 3 * 120 and all("\n\n" not in document for document in documents)
    held_out = {document for document in documents if is_validation_document(document)}
    assert 0 < len(held_out) < 3 * VAL_FRACTION * len(documents)
    # another peer holding the files in another order, or only some of them, holds out the same documents
    reordered = list(read_documents(list(reversed(files)), "text"))
    assert {document for document in reordered if is_validation_document(document)} == held_out
    some = list(read_documents(files[1:], "text"))
    assert {document for document in some if is_validation_document(document)} == held_out & set(some)
    # a hash of the text, not Python's salted hash(): the same in a fresh interpreter
    probe = sorted(held_out)[0]
    fresh = subprocess.run([sys.executable, "-c", "import sys; from peer.tasks.hf_text import is_validation_document; "
                            "print(is_validation_document(sys.argv[1]))", probe],
                           capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert fresh.stdout.strip() == "True", fresh.stderr


def test_tokenized_splits_and_packed_sequences_are_the_same_on_every_build(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    files = sorted(str(path) for path in corpus.glob("*.txt"))
    tokenizer = byte_level_tokenizer()

    def build():
        return tokenize_splits(read_documents(files, "text"), lambda texts: encode(tokenizer, texts), 256)

    first, second = build(), build()
    assert first.train.tobytes() == second.train.tobytes() and first.val.tobytes() == second.val.tobytes()
    documents = list(read_documents(files, "text"))
    train_text = "".join(document + "\n\n" for document in documents if not is_validation_document(document))
    # byte-level: the ids are the bytes, and the documents follow each other, each ending in a blank line
    assert first.train.astype("uint8").tobytes() == train_text.encode()
    assert first.train_documents + first.val_documents == len(documents)

    packed = PackedSequences(first.train, seq_len=64)
    assert len(packed) == len(first.train) // 64  # the tail that fills no sequence is dropped
    assert torch.equal(torch.cat([packed[0], packed[1]]), torch.from_numpy(first.train[:128].astype("int64")))
    assert packed[len(packed) - 1].shape == (64,) and packed[0].dtype == torch.int64
    with pytest.raises(IndexError):
        packed[len(packed)]
    spread = PackedSequences(first.train, seq_len=64, max_sequences=4)
    assert len(spread) == 4 and torch.equal(spread[0], packed[0]) and torch.equal(spread[1], packed[len(packed) // 4])


def test_json_lines_and_parquet_are_read_by_their_text_field(tmp_path):
    rows = [{"text": f"document number {index}", "id": index} for index in range(20)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert list(read_documents([str(tmp_path / "docs.jsonl")], "json")) == [row["text"] for row in rows]
    parquet = pytest.importorskip("pyarrow.parquet")  # datasets depends on pyarrow

    parquet.write_table(pytest.importorskip("pyarrow").Table.from_pylist(rows), tmp_path / "docs.parquet")
    assert list(read_documents([str(tmp_path / "docs.parquet")], "parquet")) == [row["text"] for row in rows]
    (tmp_path / "other.jsonl").write_text(json.dumps({"body": "no text field"}) + "\n")
    with pytest.raises(ValueError) as missing:
        list(read_documents([str(tmp_path / "other.jsonl")], "json"))
    assert "has no 'text' field" in one_line(missing.value) and "body" in str(missing.value)
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(ValueError) as broken:
        list(read_documents([str(tmp_path / "broken.jsonl")], "json"))
    assert one_line(broken.value).startswith(f"--data: reading its 1 json file(s) ({tmp_path / 'broken.jsonl'} "
                                             f"first) failed (ArrowInvalid: JSON parse error")


# ------------------------------------------------------------------------------------------ tokenizer


def test_the_byte_level_fallback_is_one_id_per_byte_and_saves_as_files_autotokenizer_loads(tmp_path):
    tokenizer = byte_level_tokenizer()
    text = "héllo, wörld\n\n\tx€ \x00"
    assert len(tokenizer) == 256
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tokenizer", local_files_only=True)
    assert loaded(text, add_special_tokens=False)["input_ids"] == list(text.encode())
    from_file = load_tokenizer(tmp_path / "tokenizer" / "tokenizer.json")  # --tokenizer FILE and DIRECTORY
    assert len(from_file) == len(load_tokenizer(tmp_path / "tokenizer")) == 256


def test_the_vocabulary_is_checked_against_the_models_naming_both_sizes():
    tokenizer = byte_level_tokenizer()
    check_vocabulary(tokenizer, "bytes", 256, "m")
    check_vocabulary(tokenizer, "bytes", 256 + 64, "m")  # a vocabulary padded to a round size
    with pytest.raises(TaskLoadError) as fewer:
        check_vocabulary(tokenizer, "bytes", 200, "small.json")
    assert one_line(fewer.value).startswith("--tokenizer bytes has 256 tokens but --model-config small.json has "
                                            "vocab_size 200")
    with pytest.raises(TaskLoadError) as more:
        check_vocabulary(tokenizer, "bytes", 32000, "llama.json")
    assert "has 256 tokens but --model-config llama.json has vocab_size 32000" in one_line(more.value)


# -------------------------------------------------------------------------------------- model, export


def test_the_built_in_sizes_are_about_what_they_say(tmp_path):
    assert sorted(NAMED_CONFIGS) == sorted(BUILTIN_MODEL_CONFIGS)
    sizes = {}
    for name in NAMED_CONFIGS:
        with torch.device("meta"):  # the layout only: no memory, no time
            model = AutoModelForCausalLM.from_config(load_model_config(name))
        sizes[name] = sum(param.numel() for param in model.parameters())
    assert 0.8e6 < sizes["llama-1m"] < 1.3e6 and 17e6 < sizes["llama-20m"] < 23e6, sizes


def test_the_configuration_digest_is_what_the_model_is_not_how_it_was_saved(tmp_path):
    named = load_model_config("llama-1m")
    named.save_pretrained(tmp_path / "copy")
    assert config_digest(load_model_config(str(tmp_path / "copy"))) == config_digest(named)
    assert config_digest(load_model_config(str(tmp_path / "copy" / "config.json"))) == config_digest(named)
    # the same parameter layout (which the manifest's model fingerprint sees) with another rope: another digest
    tiny_config(tmp_path / "a")
    tiny_config(tmp_path / "b", rope_theta=500000.0)
    digests = {config_digest(load_model_config(str(tmp_path / name))) for name in ("a", "b")}
    assert len(digests) == 2


@pytest.fixture
def tiny_task(tmp_path):
    options = TaskOptions(model=str(tiny_config(tmp_path / "config")), data=write_corpus(tmp_path / "corpus"),
                          seq_len=64)
    return load_task("hf-causal-lm", options=options)


def test_weights_come_from_the_seeded_rng_and_export_loads_with_from_pretrained(tiny_task, tmp_path):
    torch.manual_seed(7)
    model = tiny_task.build_model()
    torch.manual_seed(7)
    again = tiny_task.build_model()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))

    batch = torch.stack([tiny_task.build_train_dataset()[index] for index in range(4)])
    loss = tiny_task.loss_fn(model, batch)
    assert loss.ndim == 0 and 4.5 < loss.item() < 6.5  # about ln(256) before training

    tiny_task.export_model(model, tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export", local_files_only=True)
    assert (tmp_path / "export" / "model.safetensors").is_file() and len(tokenizer) == 256
    model.eval()
    with torch.no_grad():
        assert float((model(batch).logits - exported(batch).logits).abs().max()) <= 1e-5
    # and --init-from that directory starts from exactly those weights
    resumed = load_task("hf-causal-lm", options=TaskOptions(init_from=tmp_path / "export", seq_len=64)).build_model()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed.state_dict().values()))


def test_every_checkpoint_records_the_task_options(tmp_path):
    config = load_config(flags={"task": "hf-causal-lm", "data": str(write_corpus(tmp_path / "corpus")),
                                "seq_len": 64, "model_config": "llama-1m"})
    model = torch.nn.Linear(2, 2)
    optimizer = SimpleNamespace(scheduler=None, local_epoch=3, state_dict=lambda: {})
    task = load_task("hf-causal-lm", options=config.task)
    state = training_state(config, task, model, optimizer, PeerSummary(run_id="r", task="hf-causal-lm"),
                           MixedPrecision("fp32", torch.device("cpu"), model.parameters()),
                           SimpleNamespace(state_dict=lambda: {}))
    recorded = TaskOptions(**json.loads(json.dumps(state["task_options"])))  # what `peer export` rebuilds from
    assert recorded == TaskOptions(model="llama-1m", data=tmp_path / "corpus", seq_len=64)
    assert Path(state["task_options"]["data"]).is_absolute()
    # and what the files behind them held, which export compares (the starting point: the run's seed)
    assert state["task_digests"] == dict(task.shared_digests) and state["task_digests"]["init_from"] == "seeded"


# ---------------------------------------------------------------------------------- bad input, one line


@pytest.mark.parametrize("options, expected", [
    (dict(model="meta-llama/Llama-3.2-1B"), "--model-config meta-llama/Llama-3.2-1B: not a local path, and this "
                                            "peer never downloads from the Hugging Face Hub; pass the path of a "
                                            "local config.json"),
    (dict(model="{tmp}/missing/config.json"), "--model-config {tmp}/missing/config.json: no such file or directory"),
    (dict(tokenizer="gpt2"), "--tokenizer gpt2: not a local path, and this peer never downloads"),
    (dict(model="{tmp}/not-json.json"), "--model-config {tmp}/not-json.json: not a model configuration"),
    (dict(tokenizer="{tmp}/not-json.json"), "--tokenizer {tmp}/not-json.json: not a tokenizer transformers reads"),
    (dict(model="{tmp}/tiny", tokenizer="{tmp}/big-tokenizer"),
     "--tokenizer {tmp}/big-tokenizer has 300 tokens but --model-config {tmp}/tiny has vocab_size 256"),
    (dict(model="{tmp}/tiny", seq_len=512), "--seq-len 512 is longer than --model-config {tmp}/tiny allows "
                                            "(max_position_embeddings 128)"),
])
def test_what_the_task_cannot_build_from_is_one_line_naming_the_flag(tmp_path, options, expected):
    (tmp_path / "not-json.json").write_text("{ not json")
    tiny_config(tmp_path / "tiny")
    big = byte_level_tokenizer()
    big.add_tokens([f"<extra-{index}>" for index in range(44)])
    big.save_pretrained(tmp_path / "big-tokenizer")
    given = {key: value.format(tmp=tmp_path) if isinstance(value, str) else value for key, value in options.items()}
    with pytest.raises(TaskLoadError) as refused:
        load_task("hf-causal-lm", options=TaskOptions(**given))
    assert one_line(refused.value).startswith(expected.format(tmp=tmp_path)), str(refused.value)


def test_options_given_to_a_task_that_takes_none_are_refused():
    for task in ("bytelm-tiny", "examples.custom_task:make_task"):
        with pytest.raises(TaskLoadError) as refused:
            load_task(task, options=TaskOptions(seq_len=64, tokenizer=Path("t.json")))
        assert one_line(refused.value) == (f"--tokenizer, --seq-len: options of --task hf-causal-lm, which --task "
                                           f"{task} does not take; drop them, or use --task hf-causal-lm")


def test_too_little_held_out_text_is_one_line(tmp_path):
    (tmp_path / "one.txt").write_text("a single short document")
    task = load_task("hf-causal-lm", options=TaskOptions(model=str(tiny_config(tmp_path / "tiny")),
                                                         data=tmp_path / "one.txt", seq_len=64))
    with pytest.raises(ValueError) as refused:
        task.build_val_dataset()
    assert "held out for validation" in one_line(refused.value) and "--seq-len 64" in str(refused.value)


def test_without_the_hf_extra_the_task_names_what_to_install(monkeypatch):
    for name in [name for name in sys.modules if name.startswith(("peer.tasks.hf_", "transformers"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed: importing it fails
    with pytest.raises(TaskLoadError) as refused:
        load_task("hf-causal-lm", options=TaskOptions(seq_len=64))
    assert one_line(refused.value) == (
        "--task hf-causal-lm needs the optional packages transformers, datasets, tokenizers and safetensors "
        "(transformers cannot be imported); install them: pip install -e '.[hf]'")


def run_start(tmp_path: Path, *args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """`peer start` in a fresh interpreter; `prelude` runs first (to hide a package)."""
    code = f"{prelude}\nfrom peer.cli.entry import run\nrun()"
    return subprocess.run([sys.executable, "-c", code, "start", "--checkpoint-dir", str(tmp_path / "ckpt"),
                           "--metrics-port", "0", *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"})


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["vocabulary", "extra", "records"])
def test_peer_start_exits_2_with_one_line(tmp_path, case):
    corpus = write_corpus(tmp_path / "corpus", files=1, paragraphs=40)
    if case == "records":  # read when the datasets are built: a task's data it cannot read is bad input too
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"body": "no text here"}) + "\n" for _ in range(50)))
        result = run_start(tmp_path, "--task", "hf-causal-lm", "--data", str(tmp_path / "rows.jsonl"),
                           "--model-config", str(tiny_config(tmp_path / "tiny")))
        expected = "a json record has no 'text' field holding a string (its fields: body)"
    elif case == "vocabulary":
        tiny_config(tmp_path / "wide", vocab_size=4096)
        result = run_start(tmp_path, "--task", "hf-causal-lm", "--data", str(corpus), "--model-config",
                           str(tmp_path / "wide"))
        expected = f"has 256 tokens but --model-config {tmp_path / 'wide'} has vocab_size 4096"
    else:
        result = run_start(tmp_path, "--task", "hf-causal-lm", "--data", str(corpus),
                           prelude="import sys; sys.modules['transformers'] = None")
        expected = "pip install -e '.[hf]'"
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert [line for line in output.splitlines() if line.startswith("error: ")] == [
        line for line in output.splitlines() if expected in line] and expected in output
    assert "Traceback" not in output and "peer id" not in output  # refused before it joined anything


def test_the_join_command_carries_the_options_every_peer_must_share(tmp_path):
    from peer.cli.start import join_hint

    corpus = write_corpus(tmp_path / "corpus", files=1, paragraphs=10)
    address = "/ip4/192.168.1.5/tcp/40123/p2p/12D3KooWFpVSw4FTShHPfXTgjf5fjiiBtY2NdFq4fZDS5FgUFc9S"
    named = load_config(flags={"task": "hf-causal-lm", "data": str(corpus), "model_config": "llama-20m",
                               "seq_len": 128})
    assert ("--task hf-causal-lm --target-batch-size 4096 --model-config llama-20m --seq-len 128 "
            "--data <your own text files> --initial-peers") in join_hint(named, [address], "ab" * 16)
    config = tiny_config(tmp_path / "tiny")
    (tmp_path / "tokenizer.json").write_text("{}")
    local = load_config(flags={"task": "hf-causal-lm", "data": str(corpus), "model_config": str(config),
                               "tokenizer": str(tmp_path / "tokenizer.json")})
    assert (f"--model-config <a copy of {config}> --tokenizer <a copy of {tmp_path / 'tokenizer.json'}> --data "
            f"<your own text files>") in join_hint(local, [address], "ab" * 16)
    # a run that starts from a model's weights: every joiner starts from a copy of them (the manifest checks it)
    AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(config)).save_pretrained(tmp_path / "start")
    tuned = load_config(flags={"task": "hf-causal-lm", "data": str(corpus), "init_from": str(tmp_path / "start")})
    hint = join_hint(tuned, [address], "ab" * 16)
    assert f"--init-from <a copy of {tmp_path / 'start'}> --data <your own text files>" in hint
    assert "--model-config" not in hint  # the directory's configuration is the model's

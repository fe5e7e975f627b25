"""Tasks: the built-in byte LM really learns on held-out data, and --task fails helpfully."""
from __future__ import annotations

import multiprocessing
import pickle
import re
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from peer.task_names import BUILTIN_TASK_NAMES, check_task_name
from peer.tasks import BUILTIN_TASKS, Task, TaskLoadError, load_task
from peer.tasks.bytelm import SIZES, build_corpus, make_bytelm_task

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY = SIZES["tiny"]


@pytest.fixture(scope="module")
def tiny_task() -> Task:
    return make_bytelm_task("tiny")


def _stack(dataset, indices):
    items = [dataset[i] for i in indices]
    return tuple(torch.stack(column) for column in zip(*items))


def _train_locally(task: Task, steps: int, seed: int = 0):
    """Plain PyTorch training, no swarm; returns (initial val loss, final val loss, model)."""
    torch.manual_seed(seed)
    model = task.build_model()
    optimizer = task.build_optimizer(model.parameters())
    scheduler = task.build_scheduler(optimizer) if task.build_scheduler else None
    train, val = task.build_train_dataset(), task.build_val_dataset()
    val_batch = _stack(val, range(len(val)))

    def val_loss() -> float:
        model.eval()
        with torch.no_grad():
            loss = task.loss_fn(model, val_batch).item()
        model.train()
        return loss

    initial = val_loss()
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        indices = torch.randint(len(train), (task.batch_size,), generator=generator).tolist()
        loss = task.loss_fn(model, _stack(train, indices))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()  # one "global epoch" per step: the warmup is over quickly
    return initial, val_loss(), model


def test_bytelm_corpus_is_held_out_and_deterministic():
    first, second = build_corpus(TINY.corpus_bytes), build_corpus(TINY.corpus_bytes)

    assert first.train_files and first.val_files
    assert not set(first.train_files) & set(first.val_files)
    assert first.train_files == second.train_files and first.val_files == second.val_files
    assert len(first.train) == len(second.train) and len(first.val) == len(second.val)
    assert bytes(first.train[:256]) == bytes(second.train[:256])
    # The budget is respected and the validation share is about 5%.
    assert len(first.train) + len(first.val) <= TINY.corpus_bytes
    assert 0.02 < len(first.val) / (len(first.train) + len(first.val)) < 0.1
    # It is the stdlib's Python source, not test suites or third-party code.
    assert all(f.endswith(".py") for f in first.train_files + first.val_files)
    for f in first.train_files + first.val_files:
        parts = f.split("/")
        assert not {"test", "tests", "site-packages"} & set(parts[:-1]), f


def test_bytelm_corpus_skips_tests_and_third_party(tmp_path):
    sources = {
        "a.py": b"A" * 100,
        "pkg/b.py": b"B" * 100,
        "pkg/notes.txt": b"T" * 100,
        "pkg/tests/c.py": b"C" * 100,
        "test/d.py": b"D" * 100,
        "site-packages/e.py": b"E" * 100,
        "empty.py": b"",
    }
    for rel, content in sources.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(content)
    (tmp_path / "dangling.py").symlink_to(tmp_path / "missing.py")  # unreadable: skipped, no error

    corpus = build_corpus(10_000, root=str(tmp_path))

    assert sorted(corpus.train_files + corpus.val_files) == ["a.py", "pkg/b.py"]
    assert set(bytes(corpus.train) + bytes(corpus.val)) == {ord("A"), ord("B")}
    # The budget caps what is read, file by file.
    capped = build_corpus(60, root=str(tmp_path))
    assert len(capped.train) + len(capped.val) <= 60


def test_bytelm_task_datasets_are_deterministic_across_builds(tiny_task):
    other = make_bytelm_task("tiny")
    for build in ("build_train_dataset", "build_val_dataset"):
        a, b = getattr(tiny_task, build)(), getattr(other, build)()
        assert len(a) == len(b) > 0
        assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[len(a) - 1][1], b[len(b) - 1][1])


def test_bytelm_items_are_shifted_windows(tiny_task):
    train, val = tiny_task.build_train_dataset(), tiny_task.build_val_dataset()
    assert 0 < len(val) <= 256
    assert len(train) > 1000
    for dataset in (train, val):
        for index in (0, 1, len(dataset) - 1):
            x, y = dataset[index]
            assert x.shape == y.shape == (TINY.context,)
            assert x.dtype == y.dtype == torch.int64
            assert torch.equal(x[1:], y[:-1])
            assert int(x.min()) >= 0 and int(x.max()) < 256
    # Consecutive training windows tile the corpus: window 1 starts where window 0's input ends.
    assert torch.equal(train[1][0][:1], train[0][1][-1:])
    with pytest.raises(IndexError):
        train[len(train)]


def test_bytelm_datasets_pickle_small(tiny_task):
    # The task itself pickles too (module-level functions and partials, no lambdas).
    assert pickle.loads(pickle.dumps(tiny_task)).name == "bytelm-tiny"
    train = tiny_task.build_train_dataset()
    payload = pickle.dumps(train)
    # One byte per corpus byte plus a little framing: no python lists of bytes or tensors.
    assert len(payload) < len(train.data) + 4096
    restored = pickle.loads(payload)
    assert len(restored) == len(train)
    assert torch.equal(restored[7][0], train[7][0])


def test_bytelm_through_dataloader_workers(tiny_task):
    val = tiny_task.build_val_dataset()
    loader = DataLoader(
        val, batch_size=tiny_task.batch_size, num_workers=2, timeout=60,
        multiprocessing_context=multiprocessing.get_context("spawn"),
    )
    batches = list(loader)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert x.shape == (len(val), TINY.context)
    assert torch.equal(x, _stack(val, range(len(val)))[0])
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_bytelm_sizes():
    small, tiny = make_bytelm_task("small"), make_bytelm_task("tiny")
    assert (small.name, small.batch_size) == ("bytelm", 32)
    assert (tiny.name, tiny.batch_size) == ("bytelm-tiny", 16)
    small_params = sum(p.numel() for p in small.build_model().parameters())
    tiny_params = sum(p.numel() for p in tiny.build_model().parameters())
    assert 300_000 < small_params < 3_000_000
    assert tiny_params < 200_000
    with pytest.raises(ValueError, match="small, tiny"):
        make_bytelm_task("huge")


def test_bytelm_model_is_causal(tiny_task):
    torch.manual_seed(0)
    model = tiny_task.build_model().eval()
    x = torch.randint(0, 256, (1, TINY.context))
    changed = x.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    with torch.no_grad():
        assert torch.allclose(model(x)[0, :-1], model(changed)[0, :-1], atol=1e-6)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, TINY.context + 1, dtype=torch.int64))


def test_bytelm_tiny_learns_on_held_out_data(tiny_task):
    initial, final, _ = _train_locally(tiny_task, steps=50)
    print(f"bytelm-tiny validation loss: {initial:.3f} -> {final:.3f}")
    assert 5.0 < initial < 6.0  # about ln(256): an untrained model guesses uniformly
    assert final < 0.7 * initial


def test_bytelm_optimizer_keeps_param_groups(tiny_task):
    # The swarm optimizer passes parameter groups and requires the same grouping back.
    model = tiny_task.build_model()
    params = list(model.parameters())
    groups = [{"params": params[:3]}, {"params": params[3:]}]
    optimizer = tiny_task.build_optimizer(groups)
    assert len(optimizer.param_groups) == 2
    scheduler = tiny_task.build_scheduler(optimizer)
    assert optimizer.param_groups[0]["lr"] < TINY.learning_rate  # warming up
    for _ in range(TINY.warmup_epochs):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(TINY.learning_rate)


def test_load_builtin_task():
    task = load_task("bytelm-tiny")
    assert isinstance(task, Task) and task.name == "bytelm-tiny"


def test_load_task_suggests_close_builtin():
    with pytest.raises(TaskLoadError, match="did you mean 'bytelm'"):
        load_task("bytelmm")


@pytest.mark.parametrize("given, suggested", [
    ("examples/custom_task.py", "give --task examples.custom_task:make_task"),
    ("examples/custom_task.py:build", "give --task examples.custom_task:build"),
    ("{elsewhere}/my_task.py", "give --task my_task:make_task from {elsewhere}"),
])
def test_a_task_given_as_a_file_path_is_told_its_module_form(tmp_path, monkeypatch, given, suggested):
    monkeypatch.chdir(tmp_path / "..")
    elsewhere = str(tmp_path.parent.parent)  # above the working directory
    with pytest.raises(TaskLoadError, match="not as a file path") as error:
        load_task(given.format(elsewhere=elsewhere))
    assert suggested.format(elsewhere=elsewhere) in str(error.value)


def test_load_task_missing_module():
    with pytest.raises(TaskLoadError, match="no_such_module_xyz"):
        load_task("no_such_module_xyz:make")


def test_load_task_module_raising_on_import(tmp_path, monkeypatch):
    (tmp_path / "swarmtrain_broken_task.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(TaskLoadError, match="RuntimeError: boom at import"):
        load_task("swarmtrain_broken_task:make")


def test_load_task_rejects_non_task(tmp_path, monkeypatch):
    (tmp_path / "swarmtrain_not_a_task.py").write_text("def make():\n    return {'name': 'x'}\n")
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(TaskLoadError, match="returned dict"):
        load_task("swarmtrain_not_a_task:make")


def test_load_task_missing_function(tmp_path, monkeypatch):
    (tmp_path / "swarmtrain_empty_task.py").write_text("")
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(TaskLoadError, match="no callable 'make'"):
        load_task("swarmtrain_empty_task:make")


def test_example_custom_task_learns(monkeypatch):
    monkeypatch.syspath_prepend(REPO_ROOT)
    task = load_task("examples.custom_task:make_task")
    assert isinstance(task, Task) and task.name == "two-spirals"
    initial, final, model = _train_locally(task, steps=400)
    print(f"two-spirals validation loss: {initial:.3f} -> {final:.3f}")
    assert final < 0.8 * initial
    # Beyond the loss: the held-out points are classified far better than chance.
    points, labels = _stack(task.build_val_dataset(), range(len(task.build_val_dataset())))
    with torch.no_grad():
        accuracy = (model(points).argmax(dim=1) == labels).float().mean().item()
    assert accuracy > 0.85


def test_a_task_module_in_the_current_directory_is_found_as_the_readme_says(monkeypatch):
    """`peer start --task examples.custom_task:make_task` from the repository root: the console script's
    sys.path holds its own directory, not the current one."""
    repo_root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo_root)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(repo_root))])
    for name in [name for name in sys.modules if name == "examples" or name.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)
    task = load_task("examples.custom_task:make_task")
    assert isinstance(task, Task)


def test_every_builtin_name_the_preflight_accepts_is_a_task_the_registry_builds():
    assert tuple(BUILTIN_TASKS) == BUILTIN_TASK_NAMES


@pytest.mark.parametrize("name, expected", [
    ("bytelmm", "did you mean 'bytelm'"),
    ("examples/custom_task.py", "give --task examples.custom_task:make_task"),
    ("no_such_module_anywhere.sub:make_task", "cannot import module 'no_such_module_anywhere.sub' "
                                              "(ModuleNotFoundError: No module named 'no_such_module_anywhere')"),
    (":make_task", "cannot import module ''"),
])
def test_a_task_name_of_the_wrong_form_is_refused_before_anything_is_imported(name, expected, tmp_path, monkeypatch):
    with pytest.raises(TaskLoadError, match=re.escape(expected)):
        check_task_name(name)
    (tmp_path / "swarmtrain_loud_task.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.chdir(tmp_path)  # found from the working directory, as peer start finds it
    monkeypatch.setattr(sys, "path", list(sys.path))
    check_task_name("swarmtrain_loud_task:make_task")  # found, not imported: that is load_task's, under its timeout
    assert "swarmtrain_loud_task" not in sys.modules

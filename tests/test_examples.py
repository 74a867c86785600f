"""The example scripts, run in-process at a tiny size.

Each example's claim is checked, not just that it runs: ga_optax ends on the
large-batch parameters (to float32 rounding) and the naive loop does not.
Every run's parameters are checked to be finite first: the differences
compare NaN with NaN as equal.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from helpers import cpu_process_environment

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"

# Far above float32 rounding accumulated over a few Adam steps, far below
# what a wrongly normalised gradient moves the parameters by. The examples
# report max_relative_difference: per leaf, relative to the largest value.
EQUIVALENT = 1e-5


def load_example(name: str) -> ModuleType:
  spec = importlib.util.spec_from_file_location(
    f"example_{name}", EXAMPLES_DIR / f"{name}.py"
  )
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def classifier() -> ModuleType:
  return load_example("classifier")


@pytest.fixture(scope="module")
def lm_example() -> ModuleType:
  return load_example("lm_token_weighting")


@pytest.fixture(scope="module")
def byte_lm() -> ModuleType:
  return load_example("byte_lm")


IDX_TYPE_CODES = {
  ">u1": 0x08,
  ">i1": 0x09,
  ">i2": 0x0B,
  ">i4": 0x0C,
  ">f4": 0x0D,
  ">f8": 0x0E,
}


def write_idx(path: Path, array: np.ndarray, type_code: int | None = None):
  """Writes ``array`` as an IDX file (gzipped when the name ends in .gz)."""
  big_endian = array.astype(array.dtype.newbyteorder(">"))
  if type_code is None:
    type_code = IDX_TYPE_CODES[big_endian.dtype.str.replace("|", ">")]
  header = bytes([0, 0, type_code, array.ndim])
  header += struct.pack(f">{array.ndim}I", *array.shape)
  opener = gzip.open if path.suffix == ".gz" else open
  with opener(path, "wb") as file:
    file.write(header + big_endian.tobytes())


@pytest.mark.parametrize("dtype", list(IDX_TYPE_CODES))
@pytest.mark.parametrize("suffix", [".gz", ""])
def test_read_idx_round_trips_every_type(classifier, tmp_path, dtype, suffix):
  rng = np.random.default_rng(0)
  array = (rng.normal(size=(3, 4, 5)) * 50).astype(dtype)
  path = tmp_path / f"data-idx{suffix}"
  write_idx(path, array)

  read = classifier.read_idx(path)

  np.testing.assert_array_equal(read, array)
  assert read.shape == (3, 4, 5)
  assert read.dtype == np.dtype(dtype).newbyteorder("=")


def test_read_idx_reads_a_one_dimensional_label_file(classifier, tmp_path):
  labels = np.arange(10, dtype=np.uint8)
  write_idx(tmp_path / "labels.gz", labels)
  np.testing.assert_array_equal(
    classifier.read_idx(tmp_path / "labels.gz"), labels
  )


def test_read_idx_rejects_a_bad_magic_number(classifier, tmp_path):
  path = tmp_path / "bad.gz"
  with gzip.open(path, "wb") as file:
    file.write(b"\x1f\x00\x08\x01\x00\x00\x00\x01\x00")
  with pytest.raises(ValueError, match="not an IDX file"):
    classifier.read_idx(path)


def test_read_idx_rejects_an_unknown_type_code(classifier, tmp_path):
  path = tmp_path / "bad"
  write_idx(path, np.zeros(4, np.uint8), type_code=0x0A)
  with pytest.raises(ValueError, match="type code 0x0a"):
    classifier.read_idx(path)


def test_read_idx_rejects_data_shorter_than_the_header_says(
  classifier, tmp_path
):
  path = tmp_path / "short"
  write_idx(path, np.zeros((2, 3), np.uint8))
  path.write_bytes(path.read_bytes()[:-1])
  with pytest.raises(ValueError, match=r"5 bytes of data.*\(2, 3\)"):
    classifier.read_idx(path)


def test_load_fashion_mnist_names_the_missing_files(classifier, tmp_path):
  with pytest.raises(
    FileNotFoundError, match=re.escape("t10k-labels-idx1-ubyte.gz")
  ):
    classifier.load_fashion_mnist(tmp_path)


def write_fake_fashion_mnist(directory: Path, num_train: int, num_test: int):
  rng = np.random.default_rng(1)
  for split, count in (("train", num_train), ("t10k", num_test)):
    images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, count, dtype=np.uint8)
    write_idx(directory / f"{split}-images-idx3-ubyte.gz", images)
    write_idx(directory / f"{split}-labels-idx1-ubyte.gz", labels)


def assert_ga_matches_and_naive_does_not(results, ga_names, naive_name):
  for name, row in results.items():
    assert row["params_finite"], name
  for name in ga_names:
    assert results[name]["max_param_difference"] < EQUIVALENT, name
  assert results[naive_name]["max_param_difference"] > 10 * EQUIVALENT


def test_classifier_on_fashion_mnist_files(classifier, tmp_path, capsys):
  data_dir = tmp_path / "fashion"
  data_dir.mkdir()
  # 100 training images: one full batch of 64, then a partial window of 36.
  write_fake_fashion_mnist(data_dir, num_train=100, num_test=20)

  results = classifier.main(
    [
      *("--data-dir", str(data_dir), "--epochs", "2", "--hidden", "16"),
      *("--output-dir", str(tmp_path), "--no-progress"),
    ]
  )

  assert_ga_matches_and_naive_does_not(
    results, ["ga_optax.accumulate"], "naive loop (/ k)"
  )
  assert (tmp_path / "classifier_losses.png").stat().st_size > 0
  printed = capsys.readouterr().out
  assert (
    f"loss curves: {(tmp_path / 'classifier_losses.png').resolve()}" in printed
  )
  assert "train: 100  test: 20" in printed
  assert "the last batch of each epoch holds 36" in printed


def test_classifier_on_bundled_digits(classifier, tmp_path):
  results = classifier.main(
    [
      *("--epochs", "1", "--train-size", "150", "--hidden", "16"),
      *("--output-dir", str(tmp_path), "--no-progress"),
    ]
  )

  assert_ga_matches_and_naive_does_not(
    results, ["ga_optax.accumulate"], "naive loop (/ k)"
  )
  for row in results.values():
    assert 0.0 <= row["test_accuracy"] <= 1.0
  # Measured only when asked for.
  assert "b_simple" not in results["ga_optax.accumulate"]
  assert not (tmp_path / "noise_scale.png").exists()


def test_classifier_plots_the_noise_scale(classifier, tmp_path, capsys):
  results = classifier.main(
    [
      *("--epochs", "1", "--train-size", "300", "--hidden", "16"),
      *("--noise-scale", "--output-dir", str(tmp_path), "--no-progress"),
    ]
  )

  # Measuring leaves the training as it was.
  assert_ga_matches_and_naive_does_not(
    results, ["ga_optax.accumulate"], "naive loop (/ k)"
  )
  row = results["ga_optax.accumulate"]
  # 300 samples: four windows of 4 x 16, then 16 + 16 + 12 flushed.
  assert row["items"] == [64, 64, 64, 64, 44]
  # Every window holds at least 2 micro-batches, so each is measured and
  # the estimate is a number from the first update on.
  assert len(row["b_simple"]) == 5
  assert np.isfinite(row["b_simple"]).all(), row["b_simple"]
  plot = tmp_path / "noise_scale.png"
  assert plot.stat().st_size > 0
  printed = capsys.readouterr().out
  assert "B_simple (samples; decay 0.95) against a batch of 64" in printed
  assert f"noise scale: {plot.resolve()}" in printed


@pytest.mark.parametrize("name", ["classifier", "lm_token_weighting"])
def test_output_goes_under_the_current_directory(name, tmp_path, monkeypatch):
  # Never into the source tree, which may be read-only or a git checkout.
  monkeypatch.chdir(tmp_path)
  output_dir = load_example(name).parse_args([]).output_dir.resolve()
  assert output_dir == (tmp_path / "ga_optax_output" / name).resolve()


def test_lm_text_is_cut_at_sentence_and_paragraph_ends(byte_lm):
  text = (
    "One. Two is here.\nThree!\n\n"
    "A paragraph with no end at all but many words\n   \n"
    "abcdefghijklmnopqrstuvwxyz0123456789"
  )
  tokens = byte_lm.text_sequences([text], max_len=20)

  assert tokens.shape == (7, 22)
  assert tokens.dtype == np.int32
  pieces = []
  for row in tokens:
    assert row[0] == byte_lm.BOS
    end = int(np.flatnonzero(row == byte_lm.EOS)[0])
    assert (row[end + 1 :] == byte_lm.PAD).all()
    piece = (row[1:end] - byte_lm.NUM_SPECIAL).astype(np.uint8)
    pieces.append(piece.tobytes().decode())
  assert pieces == [
    # Whole sentences, as many as fit.
    "One. Two is here.",
    "Three!",
    # No sentence end fits: cut at the last space that does.
    "A paragraph with no",
    "end at all but many",
    "words",
    # No space either: cut at the limit.
    "abcdefghijklmnopqrst",
    "uvwxyz0123456789",
  ]


def test_lm_sequences_from_the_help_texts_vary_in_length(byte_lm):
  texts = list(byte_lm.topics.values())
  corpus = "\n\n".join(texts).encode("utf-8")
  tokens = byte_lm.text_sequences(texts, max_len=128)

  real = tokens[:, 1:] != byte_lm.PAD
  lengths = real.sum(axis=1) - 1
  assert len(tokens) > 3000
  assert lengths.min() >= 1
  assert lengths.max() == 128
  # Headings and short sentences beside full-width paragraphs: padding is
  # a large share of a batch, not an edge case.
  assert np.quantile(lengths, 0.1) < 32 < 96 < np.quantile(lengths, 0.75)
  for row, length in zip(tokens[::50], lengths[::50], strict=True):
    piece = (row[1 : length + 1] - byte_lm.NUM_SPECIAL).astype(np.uint8)
    assert piece.tobytes() in corpus


def test_lm_presets_give_way_to_the_options_given(lm_example):
  args = lm_example.parse_args(["--preset", "gpu", "--steps", "7"])
  assert args.steps == 7
  assert args.dim == lm_example.PRESETS["gpu"]["dim"]
  assert args.learning_rate == lm_example.LEARNING_RATES["adam"]
  args = lm_example.parse_args(["--optimizer", "sgd"])
  assert vars(args) | lm_example.PRESETS["cpu"] == vars(args)
  assert args.learning_rate == lm_example.LEARNING_RATES["sgd"]


def test_lm_token_weighting(lm_example, byte_lm, tmp_path, capsys):
  # Plain SGD: an update is the gradient times the learning rate, so a
  # gradient of the wrong scale moves the parameters by as much. (Adam
  # divides most of such an error out.)
  results = lm_example.main(
    [
      *("--optimizer", "sgd", "--steps", "3", "--batch-size", "8"),
      *("--every-k", "2", "--max-len", "48", "--dim", "16"),
      *("--num-heads", "2", "--num-layers", "1"),
      *("--output-dir", str(tmp_path), "--no-progress"),
    ]
  )

  assert list(results) == [
    "large batch",
    "naive (mean of means)",
    "accumulate(weight=)",
    "microbatched(weight_fn=)",
  ]
  # The reference trained, so that agreeing with it means something.
  reference = results["large batch"]
  assert reference["first_loss"] - reference["final_loss"] > 0.5
  weighted = ["accumulate(weight=)", "microbatched(weight_fn=)"]
  assert_ga_matches_and_naive_does_not(
    results, weighted, "naive (mean of means)"
  )
  for name in weighted:
    assert results[name]["relative_distance"] < EQUIVALENT
  assert results["naive (mean of means)"]["relative_distance"] > EQUIVALENT
  assert (tmp_path / "lm_token_weighting.png").stat().st_size > 0
  printed = capsys.readouterr().out
  assert f"pydoc_data.topics, {len(byte_lm.topics)} help texts" in printed
  assert "real tokens per micro-batch: " in printed
  assert f"plot: {(tmp_path / 'lm_token_weighting.png').resolve()}" in printed


# examples/data_parallel.py needs 8 simulated CPU devices, fixed when jax is
# imported: it runs in a fresh process that calls its main, and compiles at
# the test's level (tests/compile_level.py).
DATA_PARALLEL_DRIVER = """
import json, runpy, sys
import compile_level
compile_level.from_environment()
example = runpy.run_path(sys.argv[1])
print("DEFAULT_OUTPUT_DIR", example["parse_args"]([]).output_dir.resolve())
print("RESULTS " + json.dumps(example["main"](sys.argv[2:])))
"""


def run_data_parallel(cwd: Path, *args: str) -> tuple[dict, str]:
  env = cpu_process_environment(
    8, EXAMPLES_DIR.parent, Path(__file__).resolve().parent
  )
  example = EXAMPLES_DIR / "data_parallel.py"
  result = subprocess.run(
    [sys.executable, "-c", DATA_PARALLEL_DRIVER, str(example), *args],
    env=env,
    cwd=cwd,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
  printed, _, results = result.stdout.rpartition("RESULTS ")
  return json.loads(results), printed


# The shard_map mode runs the recipes of docs/how-to/data-parallel.md, which
# tests/test_distributed.py runs on 8 devices: only the default mode here,
# to keep the suite within its time.
@pytest.mark.parametrize("mode", ["jit"])
def test_data_parallel_reduces_once_per_window_and_matches_the_large_batch(
  mode, tmp_path
):
  output_dir = tmp_path / "plots"
  results, printed = run_data_parallel(
    tmp_path,
    *("--mode", mode, "--epochs", "1", "--microbatch", "4"),
    *("--accumulation-steps", "2", "--hidden", "16"),
    *("--output-dir", str(output_dir), "--no-progress"),
  )

  assert list(results) == [
    "large batch",
    "deferred, in one step",
    "deferred, across steps",
    "reduced every micro-step",
  ]
  reference = results["large batch"]
  assert reference["first_loss"] - reference["final_loss"] > 0.1
  for name, row in results.items():
    assert row["params_finite"], name
    assert row["max_param_difference"] < EQUIVALENT, name
    assert row["max_loss_difference"] < EQUIVALENT, name
  # The claim: the gradients cross the devices once per window, not once
  # per micro-step (k = 2) as when every micro-step's are reduced.
  assert {
    name: row["gradient_all_reduces_per_window"]
    for name, row in results.items()
  } == {
    "large batch": 1,
    "deferred, in one step": 1,
    "deferred, across steps": 1,
    "reduced every micro-step": 2,
  }
  plot = output_dir / "data_parallel_losses.png"
  assert plot.stat().st_size > 0
  assert f"loss curves: {plot.resolve()}" in printed
  assert f"mesh {{'data': 8}} ({mode})" in printed
  default_dir = tmp_path / "ga_optax_output" / "data_parallel"
  assert f"DEFAULT_OUTPUT_DIR {default_dir.resolve()}" in printed

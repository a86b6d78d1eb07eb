"""Where a training step's time goes: a config's teacher (or student) on its real data.

One process, on whatever this machine is doing besides (compare shares, not rates):

* input: the real training stream alone (tf.data on the same cores), ms per batch;
* padding: real tokens / padded slots per bucket, source and target, over the batches read;
* compilation: the first train step at each bucket shape (one compilation per shape);
* the step at each bucket shape, from batches in memory (median of the timed calls): the
  forward pass (the loss), forward + backward, and the whole step; the optimizer (and the
  parameter average) is the whole step minus forward + backward; attention's share of the
  step's FLOPs (benchmarks/train_throughput.py's count) and the FLOP/s reached, against the
  matmul ceiling at the model's own shapes measured in the same process;
* the loop as model/train.py runs it, fed by the stream, against the same number of steps
  fed from memory: what the input pipeline costs the steps on the shared cores;
* one dev evaluation (loss, the decoding whose BLEU is reported, BLEU) and its share of a
  run at the config's `eval_every`.

Needs the config's encode (teacher) or encode_distilled (student) artifact:

    PADIR_DATA_ROOT=/path/to/data python benchmarks/train_profile.py \\
        --config configs/multi30k_en_de.yaml [--model teacher|phase1|phase2] [--set k=v]
"""

from __future__ import annotations

import argparse
import collections
import functools
import math
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import train_throughput  # noqa: E402
from components import config as config_lib  # noqa: E402
from model import refinement, sharding, train
from pipelines import training  # noqa: E402


def _median_seconds(fn, calls: int) -> float:
    """Median wall time of `calls` calls of `fn()` (each blocked until ready), after one."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_batches(data: train.TrainData, count: int) -> tuple[list[dict], float]:
    """The stream's first `count` batches and the median seconds per batch (after the first,
    which starts the pipeline)."""
    stream = data.batches(0)
    batches, times = [], []
    for _ in range(count):
        start = time.perf_counter()
        batches.append(next(stream)[1])
        times.append(time.perf_counter() - start)
    return batches, statistics.median(times[1:])


def padding_table(batches: list[dict]) -> list[dict]:
    """Per bucket width: batches, and real tokens over padded slots of sources and targets."""
    by_shape = collections.defaultdict(lambda: np.zeros(5, np.int64))
    for batch in batches:
        source, target = batch["source"], batch["target"]
        by_shape[target.shape] += (1, np.count_nonzero(source), source.size,
                                   np.count_nonzero(target), target.size)
    return [{"width": width, "rows": rows, "batches": int(n), "source_real": src / src_slots,
             "target_real": tgt / tgt_slots}
            for (rows, width), (n, src, src_slots, tgt, tgt_slots) in sorted(
                by_shape.items(), key=lambda item: item[0][1])]


def profile(config: config_lib.Config, which: str, args: argparse.Namespace) -> None:
    stage = "teacher" if which == "teacher" else "student"
    section = config.section(stage)
    tokenizer = training.load_tokenizer(config)
    data = training.training_data(config, stage, tokenizer)
    if stage == "teacher":
        model, loss_options = training.teacher_model(config, tokenizer), {}
        predict, num_steps = None, section.steps
    else:
        model = training.student_model(config, tokenizer)
        stages_unrolled = 1 if which == "phase1" else section.num_stages
        loss_options = dict(num_stages=stages_unrolled, remask_stutter=section.remask_stutter)
        predict = functools.partial(refinement.predict_refined, model,
                                    max_iterations=train.STUDENT_DEV_ITERATIONS)
        num_steps = section.phase1_steps if which == "phase1" else section.phase2_steps
    optimizer = section.optimizer
    tx, _ = train.make_optimizer(optimizer, num_steps)
    placement = train.place(model, tx, config.mesh, ema=optimizer.ema_decay is not None)
    state = placement.create_state(config.seed)
    steps = train.compile_steps(model, tx, placement.state_shardings, placement.batch_sharding,
                                ema_decay=optimizer.ema_decay, predict=predict, **loss_options)
    print(f"## {which}: {model.config.num_encoder_layers}+{model.config.num_decoder_layers} "
          f"layers, d_model {model.config.d_model}, vocab {tokenizer.vocab_size}, "
          f"{section.loop.tokens_per_batch} tokens per batch, {num_steps} steps\n", flush=True)

    batches, input_s = read_batches(data, args.batches)
    print(f"input pipeline alone: {1e3 * input_s:.1f} ms per batch (median of {args.batches})\n")
    print("| bucket width | rows | batches read | source real/padded | target real/padded |")
    print("|---|---|---|---|---|")
    padding = padding_table(batches)
    for row in padding:
        print(f"| {row['width']} | {row['rows']} | {row['batches']} | {row['source_real']:.0%} "
              f"| {row['target_real']:.0%} |")

    def loss(params, batch, rng):
        return model.loss_fn(params, batch, rng, **loss_options)

    forward = jax.jit(loss)
    backward = jax.jit(jax.value_and_grad(loss, has_aux=True))
    rng = jax.random.PRNGKey(0)
    print("\n| bucket width | compile s | forward ms | forward+backward ms | step ms "
          "| optimizer ms | attention FLOPs | GFLOP/s | of own-shape ceiling |")
    print("|---|---|---|---|---|---|---|---|---|")
    step_ms = {}
    for row in padding:
        batch = next(b for b in batches if b["target"].shape[1] == row["width"])
        on_device = sharding.shard_batch(batch, placement.batch_sharding)
        start = time.perf_counter()
        state, _ = steps.train(state, on_device)
        jax.block_until_ready(state)
        compile_s = time.perf_counter() - start
        fwd = _median_seconds(lambda: forward(state.params, on_device, rng), args.calls)
        fwd_bwd = _median_seconds(lambda: backward(state.params, on_device, rng), args.calls)

        def whole():
            nonlocal state
            state, metrics = steps.train(state, on_device)
            return state, metrics

        step = _median_seconds(whole, args.calls)
        step_ms[row["width"]] = 1e3 * step
        rows, width = batch["target"].shape
        flops, attention, _ = train_throughput.step_flops(
            state.params, model.config, tokenizer.vocab_size, rows, width, width,
            stage == "student", loss_options.get("num_stages", 1))
        ceiling = train_throughput.model_shapes_flops_per_s(rows * width, model.config,
                                                            tokenizer.vocab_size)
        print(f"| {row['width']} | {compile_s:.1f} | {1e3 * fwd:.0f} | {1e3 * fwd_bwd:.0f} "
              f"| {1e3 * step:.0f} | {1e3 * (step - fwd_bwd):.0f} | {attention / flops:.0%} "
              f"| {flops / step / 1e9:.0f} | {flops / step / ceiling:.0%} |", flush=True)

    memory_s, state = _loop_seconds(steps, state, iter(batches), placement, args.loop_steps)
    stream = (batch for _, batch in data.batches(0))
    next(stream)  # the pipeline's start-up, as before a run's first step
    streamed_s, state = _loop_seconds(steps, state, stream, placement, args.loop_steps)
    mix = sum(row["batches"] * step_ms[row["width"]] for row in padding) / len(batches)
    print(f"\nthe loop, {args.loop_steps} steps: from memory {1e3 * memory_s:.0f} ms a step, fed "
          f"by the stream {1e3 * streamed_s:.0f} ms (input on the shared cores: "
          f"{streamed_s / memory_s - 1:+.0%}); the buckets' step times weighted by the batches "
          f"read: {mix:.0f} ms")

    dev = train.DevSet(data.dev_batches, jax.random.PRNGKey(1), detokenize=data.detokenize,
                       references=data.references, target_lang=data.target_lang)
    train.evaluate(steps, state.eval_params, dev, placement.batch_sharding)  # compiles
    start = time.perf_counter()
    metrics = train.evaluate(steps, state.eval_params, dev, placement.batch_sharding)
    eval_s = time.perf_counter() - start
    evaluations = math.ceil(num_steps / section.loop.eval_every)
    share = evaluations * eval_s / (evaluations * eval_s + num_steps * streamed_s)
    print(f"one dev evaluation ({len(data.references)} sentences, loss + decoding + BLEU): "
          f"{eval_s:.1f} s; {evaluations} in a run of {num_steps} steps: {share:.1%} of it "
          f"(dev BLEU now {metrics.get('bleu', float('nan')):.2f})\n", flush=True)


def _loop_seconds(steps: train.CompiledSteps, state: train.TrainState, batches, placement,
                  count: int) -> tuple[float, train.TrainState]:
    """Seconds per step of the training loop's pattern (next batch, shard, dispatch the
    step) over `count` batches, blocking once at the end, as model/train.py does between log
    points; and the state after them (the step donates its input state)."""
    start = time.perf_counter()
    for _ in range(count):
        batch = next(batches)
        state, metrics = steps.train(state, sharding.shard_batch(batch, placement.batch_sharding))
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - start) / count, state


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/multi30k_en_de.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--model", default="teacher", choices=("teacher", "phase1", "phase2"))
    parser.add_argument("--batches", type=int, default=200, help="stream batches read")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per measurement")
    parser.add_argument("--loop-steps", type=int, default=40)
    args = parser.parse_args(argv)
    config = config_lib.load(args.config, args.set)
    profile(config, args.model, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

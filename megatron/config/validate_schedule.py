"""Validation of the training length and the schedules (Megatron-LM's rules): steps or samples, the
learning-rate and weight-decay schedules' lengths and ends, and the batch-size schedules. Called by
``validate.validate`` in its order; each check raises ConfigError with a sentence, or fills a derived value.
"""

from __future__ import annotations

from megatron.config.batch_schedule import build_batch_schedule, parse_step_schedule, train_steps
from megatron.config.cli import fail as _fail
from megatron.config.schema import Config


def check_optimizer(config: Config, warnings: list[str]) -> None:
    o, lr = config.optimizer, config.optimizer.lr
    if lr.max_lr < 0 or lr.min_lr < 0:
        _fail(f"max_lr and min_lr must be >= 0, got {lr.max_lr:g} and {lr.min_lr:g}.")
    if o.weight_decay < 0:
        _fail(f"weight_decay must be >= 0, got {o.weight_decay:g}.")
    if o.adam_epsilon <= 0:
        _fail(f"adam_epsilon must be positive, got {o.adam_epsilon:g}.")
    if lr.max_lr < lr.min_lr:
        warnings.append(f"max_lr ({lr.max_lr:g}) is below min_lr ({lr.min_lr:g}): the 'decay' will raise the "
                        f"learning rate. The FleetX example had this bug; swap them unless you mean it.")
    if not 0 <= lr.warmup_init <= lr.max_lr:
        _fail(f"warmup_init ({lr.warmup_init:g}) must be in [0, max_lr ({lr.max_lr:g})]: warm-up rises from it.")
    _check_decoupled_lr(lr)
    if o.no_weight_decay_cond_type == "apply_wd_to_qk_layernorm":  # Megatron-LM's deprecated spelling
        o.apply_wd_to_qk_layernorm = True
    _check_lr_lengths(config)
    _check_weight_decay(config)
    if o.grad_clip < 0:
        _fail(f"grad_clip must be >= 0 (0 disables clipping), got {o.grad_clip}.")
    if not (0 <= o.adam_beta1 < 1 and 0 <= o.adam_beta2 < 1):
        _fail(f"adam_beta1 and adam_beta2 must be in [0, 1), got {o.adam_beta1} and {o.adam_beta2}.")
    if not 0 <= o.sgd_momentum < 1:
        _fail(f"sgd_momentum must be in [0, 1) (0: plain SGD), got {o.sgd_momentum}.")


def _check_decoupled_lr(lr) -> None:
    """Megatron-LM's --decoupled-lr / --decoupled-min-lr: the word embedding's and output layer's own peak and
    floor, non-negative; the floor only with the peak, and the warm-up's start below it."""
    if lr.decoupled_min_lr is not None and lr.decoupled_lr is None:
        _fail(f"decoupled_min_lr ({lr.decoupled_min_lr:g}) is the floor of decoupled_lr's schedule, which is unset: "
              f"give --decoupled-lr too, or drop --decoupled-min-lr.")
    if lr.decoupled_lr is None:
        return
    floor = lr.min_lr if lr.decoupled_min_lr is None else lr.decoupled_min_lr
    if lr.decoupled_lr < 0 or floor < 0:
        _fail(f"decoupled_lr and decoupled_min_lr must be >= 0, got {lr.decoupled_lr:g} and {floor:g}.")
    if lr.warmup_init > lr.decoupled_lr:
        _fail(f"warmup_init ({lr.warmup_init:g}) must be at most decoupled_lr ({lr.decoupled_lr:g}): the embedding's "
              f"and output layer's warm-up rises from it too.")


def _check_lr_lengths(config: Config) -> None:
    """The decay and warm-up lengths in the run's unit, steps or samples (with train_samples): decay_steps
    defaults to max_steps, decay_samples to train_samples (filled in, as Megatron-LM); the warm-up is
    warmup_steps / warmup_samples when given, else warmup_rate x the decay, left fractional and not filled
    in (Megatron's). The warm-up ends before the decay does, and WSD has the length of its final decay."""
    lr = config.optimizer.lr
    if config.train_samples is None:
        if lr.decay_steps is None:
            lr.decay_steps = config.max_steps
        unit, flag, decay, warmup, wsd = "steps", "iters", lr.decay_steps, lr.warmup_steps, lr.wsd_decay_steps
    else:
        if lr.decay_samples is None:
            lr.decay_samples = config.train_samples
        unit, flag, decay, warmup, wsd = "samples", "samples", lr.decay_samples, lr.warmup_samples, lr.wsd_decay_samples
    if warmup is None:
        if not 0.0 <= lr.warmup_rate <= 1.0:
            _fail(f"warmup_rate must be in [0, 1], got {lr.warmup_rate}.")
        warmup = lr.warmup_rate * decay
    if warmup < 0 or decay < 1:
        _fail(f"warmup_{unit} ({warmup:g}) must be >= 0 and decay_{unit} ({decay}) >= 1.")
    if warmup >= decay:
        _fail(f"the warm-up ({warmup:g} {unit}) must end before the decay does (decay_{unit} {decay}), as in "
              f"Megatron-LM; shorten the warm-up or lengthen the decay.")
    for name in ("wsd_decay_steps", "wsd_decay_samples"):  # refused even when unused: a negative length is no length
        if getattr(lr, name) is not None and getattr(lr, name) < 1:
            _fail(f"{name} must be at least 1, got {getattr(lr, name)}.")
    if lr.decay_style == "WSD" and (wsd is None or wsd < 1):
        _fail(f"decay_style WSD needs the length of its final decay: wsd_decay_{unit} (--lr-wsd-decay-{flag}) of "
              f"at least 1, got {wsd}.")


def _check_weight_decay(config: Config) -> None:
    """Megatron-LM's weight-decay schedule: start_weight_decay and end_weight_decay belong to a linear or
    cosine one (each defaults to weight_decay, filled in) and the decay only grows."""
    o = config.optimizer
    ends = [name for name in ("start_weight_decay", "end_weight_decay") if getattr(o, name) is not None]
    if o.weight_decay_incr_style == "constant":
        if ends:
            _fail(f"{' and '.join(ends)} set with weight_decay_incr_style constant: they are the ends of a weight-"
                  f"decay schedule; give --weight-decay-incr-style linear or cosine, or only --weight-decay.")
        return
    o.start_weight_decay = o.weight_decay if o.start_weight_decay is None else o.start_weight_decay
    o.end_weight_decay = o.weight_decay if o.end_weight_decay is None else o.end_weight_decay
    if not 0 <= o.start_weight_decay <= o.end_weight_decay:
        _fail(f"the weight decay goes from start_weight_decay ({o.start_weight_decay:g}) up to end_weight_decay "
              f"({o.end_weight_decay:g}), both >= 0, as in Megatron-LM; swap or fix them.")


_DEFAULT_MAX_STEPS = Config().max_steps


def check_training_length(config: Config) -> None:
    """Megatron-LM's two ways of giving the training length, never mixed: steps (max_steps, decay_steps,
    warmup_steps, wsd_decay_steps) or samples (train_samples, decay_samples, warmup_samples,
    wsd_decay_samples). max_steps always has a value (FleetX's default, 500000): only another value counts
    as given, so ``--train-iters 500000`` with ``--train-samples`` goes unnoticed (train_samples decides). A
    warm-up of 0 of the other kind is Megatron's default and allowed (its scripts pass --lr-warmup-samples 0)."""
    lr = config.optimizer.lr
    samples = {"decay_samples": lr.decay_samples, "warmup_samples": lr.warmup_samples or None,
               "wsd_decay_samples": lr.wsd_decay_samples}
    if config.train_samples is None:
        given = [name for name, value in samples.items() if value is not None]
        if given:
            _fail(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} counted in samples, which needs "
                  f"train_samples (--train-samples); with max_steps give decay_steps, warmup_steps or "
                  f"wsd_decay_steps instead.")
        if config.batch_size.rampup_batch_size is not None:
            _fail("rampup_batch_size needs train_samples (--train-samples), as in Megatron-LM (the ramp is counted "
                  "in samples); step_batch_size_schedule works with max_steps too.")
        return
    steps = {"max_steps": None if config.max_steps == _DEFAULT_MAX_STEPS else config.max_steps,
             "decay_steps": lr.decay_steps, "warmup_steps": lr.warmup_steps or None,
             "wsd_decay_steps": lr.wsd_decay_steps}
    given = [name for name, value in steps.items() if value is not None]
    if given:
        one = len(given) == 1
        _fail(f"train_samples counts training in samples, but {', '.join(given)} {'is' if one else 'are'} counted in "
              f"steps; drop {'it' if one else 'them'} (the sample-based ones are decay_samples, warmup_samples and "
              f"wsd_decay_samples).")
    if config.train_samples < 1:
        _fail(f"train_samples must be at least 1, got {config.train_samples}.")


def resolve_batch_schedule(config: Config) -> None:
    """Before the batch sizes are derived: the two batch-size schedules exclude each other and need an explicit
    micro_batch_size (each step's batch is whole micro-batches); the step schedule's last batch is the global
    batch. Megatron-LM refuses --global-batch-size with --step-batch-size-schedule; here one equal to that last
    batch is accepted (its 175B example passes both, and a resumed run's saved configuration holds it)."""
    b = config.batch_size
    if b.rampup_batch_size is None and b.step_batch_size_schedule is None:
        return
    if b.rampup_batch_size is not None and b.step_batch_size_schedule is not None:
        _fail("rampup_batch_size and step_batch_size_schedule are both set; choose one (Megatron-LM replaced the "
              "ramp-up by the step schedule).")
    if b.micro_batch_size is None:
        _fail("a batch-size schedule (rampup_batch_size or step_batch_size_schedule) needs micro_batch_size: every "
              "step's global batch is a whole number of micro-batches on each data-parallel rank.")
    if b.step_batch_size_schedule is None:
        return
    try:
        last = parse_step_schedule(b.step_batch_size_schedule, config.dataset.max_seq_len)[-1][1]
    except ValueError as err:
        _fail(f"{err}.")
    if b.global_batch_size not in (None, last):
        _fail(f"global_batch_size ({b.global_batch_size}) is not the last batch of step_batch_size_schedule "
              f"({last}), which is the run's final global batch; drop --global-batch-size or make them equal.")
    b.global_batch_size = last


def check_batch_schedule(config: Config, warnings: list[str]) -> None:
    """Every global batch of the run (megatron.config.batch_schedule): never decreasing, rounded down to whole
    micro-batches per data-parallel rank (Megatron-LM's --decrease-batch-size-if-needed rule, said in a
    warning), a multiple of pp_degree micro-batches under the interleaved schedule, and train_samples worth at
    least one step."""
    try:
        schedule = build_batch_schedule(config)
    except ValueError as err:
        _fail(f"{err}.")
    unit, pp = schedule.unit, config.distributed.pp_degree
    sizes = [batch // unit * unit for _, batch in schedule.thresholds]
    if any(before > after for before, after in zip(sizes, sizes[1:])):
        _fail(f"the global batch of a batch-size schedule never decreases (Megatron-LM stops when its micro-batches "
              f"do), but this one goes {' -> '.join(map(str, sizes))}.")
    rounded = schedule.rounded()
    if rounded:
        pairs = ", ".join(f"{b} to {r}" for b, r in rounded[:4]) + (", ..." if len(rounded) > 4 else "")
        warnings.append(f"global batch sizes of the batch-size schedule that are not multiples of micro_batch_size "
                        f"x data-parallel size ({unit}) are rounded down: {pairs}.")
    if config.distributed.virtual_pp_degree > 1:
        bad = [size for size in schedule.sizes() if (size // unit) % pp]
        if bad:
            _fail(f"the interleaved schedule needs the micro-batches of every step to be a multiple of pp_degree "
                  f"({pp}), but a global batch of {bad[0]} is {bad[0] // unit} micro-batches of micro_batch_size x "
                  f"data-parallel size ({unit}); use global batches that are multiples of {unit * pp}.")
    if config.train_samples is not None and train_steps(config, schedule) < 1:
        _fail(f"train_samples ({config.train_samples}) is less than one global batch ({schedule.final}): "
              f"nothing would be trained.")

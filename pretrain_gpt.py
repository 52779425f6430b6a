"""Pretrain a GPT.

    python pretrain_gpt.py -c examples/configs/gpt_345m_single_card.yaml
    python pretrain_gpt.py --input-dir data/corpus_text_document --tokenizer-type GPT2BPETokenizer \\
        --vocab-file vocab.json --merge-file merges.txt --num-layers 12 ...
    python pretrain_gpt.py --mock-data --device cpu --num-layers 2 --hidden-size 128 ...

Every YAML leaf key is also a flag (``--hidden-size``, ``--max-lr``, ``--use-recompute``);
precedence: built-in default < ``-c`` YAML < ``-o Section.key=value`` < flags.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from functools import partial

import torch

from megatron import device as dev
from megatron.checkpoint import CheckpointError, resumed_config
from megatron.config import Config, ConfigError, validate
from megatron.config.batch_schedule import total_train_samples
from megatron.data.blended_dataset import build_datasets, build_per_split_datasets, parse_input_dir
from megatron.data.fim import fim_tokens, with_fim
from megatron.data.indexed_dataset import DatasetError
from megatron.data.mock_dataset import build_mock_datasets
from megatron.health import TrainingDiverged
from megatron.initialize import launch_env, shutdown
from megatron.memory.check import check_memory
from megatron.model.mtp import MTPInputs
from megatron.parallelize_gpt import build_model
from megatron.pretrain import pretrain
from megatron.tokenizer import Tokenizer, TokenizerError, configured_tokenizer
from megatron.training.rerun import RerunExit


def model_provider(config: Config, device: torch.device, meta_init: bool = False) -> torch.nn.Module:
    """This rank's part of the GPT; ``meta_init`` (ZeRO stage 3) builds it on the meta device, to be
    initialised straight into the shards."""
    return build_model(config, device, meta_init=meta_init)


def datasets_provider(config: Config, tokenizer: Tokenizer | None = None) -> tuple:
    """(train, valid, test): samples for max_steps global batches (with num_train_epochs, at most that many
    passes over the train split, in whole global batches), and eval_iters batches each for validation (the
    same batches at every evaluation) and test. Every dataset's token ids are checked against the model's
    (unpadded) vocabulary first: an id out of range stops every rank. Real data needs the run's ``tokenizer``
    (built once, by ``resolve``; ``main`` binds it), for its end-of-document id."""
    gbs, seq, d = config.batch_size.global_batch_size, config.dataset.max_seq_len, config.dataset
    eval_samples = config.eval_iters * (config.eval_global_batch_size or config.batch_size.global_batch_size)
    num_samples = (total_train_samples(config), eval_samples, eval_samples)
    if d.mock_data:
        return build_mock_datasets(num_samples, seq, config.model.vocab_size, config.seed, report=True,
                                   document_length=d.mock_document_length)
    if tokenizer is None:
        raise ValueError("datasets_provider: real data needs the run's tokenizer (configured_tokenizer).")
    if d.train_data_path:  # each split its own data: no split applied, no validation without valid_data_path
        build = partial(build_per_split_datasets, (d.train_data_path, d.valid_data_path, d.test_data_path))
    else:
        build = partial(build_datasets, d.input_dir, d.split)
    datasets = build(num_samples, seq, config.seed, tokenizer.eod, d.data_cache_path,
                     vocab_size=config.model.vocab_size, train_epochs=config.num_train_epochs, global_batch_size=gbs,
                     report=True)
    return with_fim(datasets, config, tokenizer) if d.fim_data else datasets  # --fim-data: megatron/data/fim.py


def loss_fn(loss_mask: torch.Tensor, token_losses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of masked token losses, number of loss tokens)."""
    return (token_losses * loss_mask).sum(), loss_mask.sum()


def forward_step(batch: dict, model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
    token_losses = model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                         document_ids=batch.get("document_ids"), mtp=MTPInputs.from_batch(batch))
    return token_losses, partial(loss_fn, batch["loss_mask"])


def resolve(argv: list[str] | None, warnings: list[str]) -> tuple[Config, Tokenizer | None]:
    """The validated configuration and the run's tokenizer, before any process group exists: the command line
    over the resumed run's saved configuration, if any (``resumed_config``); the tokenizer built once, from
    that configuration, its vocabulary size given to validation; the data prefixes must exist; with --fim-data
    the tokenizer must hold the FIM tokens (``megatron.data.fim.fim_tokens``); the predicted peak memory must
    fit (``megatron.memory.check``). Each failure is a one-line error (ConfigError, CheckpointError,
    TokenizerError)."""
    world_size, _, _ = launch_env()  # torchrun's variables, checked before anything else
    config = resumed_config(argv, warnings)
    tokenizer = configured_tokenizer(config.tokenizer, config.model.vocab_size)  # NullTokenizer's --vocab-size
    warnings += validate(config, world_size=world_size, cuda_available=dev.cuda_available(),
                         tokenizer_vocab_size=None if tokenizer is None else tokenizer.vocab_size)
    for name in ("input_dir", "train_data_path", "valid_data_path", "test_data_path"):
        if getattr(config.dataset, name):
            try:
                parse_input_dir(getattr(config.dataset, name), name)  # the prefixes exist (validation reads no files)
            except DatasetError as err:
                raise ConfigError(f"{err}.") from None
    if config.dataset.fim_data:
        fim_tokens(config.dataset, tokenizer)  # the tokenizer holds the FIM tokens: else a ConfigError
    check_memory(config)  # each rank alone: a predicted peak above its device's memory is a ConfigError
    return config, tokenizer


JOB_ERROR_WAIT_S = 30.0  # how long a rank other than 0 waits for torchrun to stop it after rank 0's error


def _stopped_by_launcher(timeout: float) -> bool:
    """Whether torchrun's SIGTERM (sent to every worker once one has exited with an error) arrives within
    ``timeout`` seconds; taken here, the rank then exits with its own status."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return signal.sigtimedwait([signal.SIGTERM], timeout) is not None
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _error(err: BaseException, status: int, once_per_job: bool) -> int:
    """``pretrain_gpt.py: error: ...`` and the exit status. ``once_per_job`` (the script run by torchrun, where the
    error is each rank's: the configuration, the data, the checkpoint are read alike by all): rank 0 prints it; the
    others print nothing and exit with the same status when torchrun stops them (at rank 0's exit), or print their
    own after ``JOB_ERROR_WAIT_S`` if it does not (rank 0 did not fail). ``main`` called in-process prints on every
    rank."""
    if once_per_job and int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("RANK", "0") != "0":
        if _stopped_by_launcher(JOB_ERROR_WAIT_S):
            return status
    print(f"pretrain_gpt.py: error: {err}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None, once_per_job: bool = False) -> int:
    """The run; its exit status (0, or 2 for an error of the configuration, data or checkpoint, printed on one line:
    by every rank, or with ``once_per_job`` by rank 0 alone, see ``_error``)."""
    try:
        warnings: list[str] = []
        config, tokenizer = resolve(argv, warnings)
    except (ConfigError, CheckpointError, TokenizerError) as err:
        return _error(err, 2, once_per_job)
    try:
        pretrain(config, model_provider, partial(datasets_provider, tokenizer=tokenizer), forward_step,
                 tuple(warnings))
    except (DatasetError, CheckpointError, ConfigError) as err:  # data, checkpoint or launch that cannot serve the run
        return _error(err, 2, once_per_job)
    except KeyboardInterrupt:  # a second Ctrl-C (the first one saves and stops at the end of the step)
        print("pretrain_gpt.py: error: interrupted (Ctrl-C twice): stopped at once, nothing saved since the last "
              "checkpoint", file=sys.stderr)
        return 130
    except TrainingDiverged as err:  # the same decision on every rank: the loss and the skips are global
        return _error(err, 3, once_per_job)
    except RerunExit as err:  # the rerun state machine's decision, reduced over every rank: 16 or 17, as Megatron-LM
        return _error(err, err.exit_code, once_per_job)
    finally:
        shutdown()  # tear the process groups down before exit (gloo's threads must not outlive them)
    return 0


if __name__ == "__main__":
    sys.exit(main(once_per_job=True))

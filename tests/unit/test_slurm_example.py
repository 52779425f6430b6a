"""examples/slurm/pretrain_gpt_multinode.sbatch: valid bash, and what it launches is a valid run.

The script runs with stand-ins for ``scontrol`` (prints the job's hosts), ``srun`` (runs its command
as the second node would) and ``torchrun`` (records its arguments), so its launcher flags and the
pretrain_gpt.py flags it builds are checked without Slurm."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from megatron.config import parse_config, validate

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm" / "pretrain_gpt_multinode.sbatch"

FAKES = {
    "scontrol": 'printf "gpu-07\\ngpu-08\\n"',
    "srun": 'while [[ "$1" == -* ]]; do shift; done; SLURM_NODEID=1 exec "$@"',
    "torchrun": 'printf "%s\\0" "$@" > "$RECORD"',
}


def _launch(tmp_path: Path, *args: str) -> tuple[list[str], list[str]]:
    """(torchrun's own flags, pretrain_gpt.py's flags) as the script passes them on node 1 of 2."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKES.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(tmp_path / "argv"),
           "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
           "SLURM_SUBMIT_DIR": str(ROOT), "TMPDIR": "/local/scratch"}
    subprocess.run(["bash", str(SCRIPT), *args], env=env, cwd=tmp_path, check=True, capture_output=True)
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    split = argv.index("pretrain_gpt.py")
    return argv[:split], argv[split + 1:]


def test_slurm_example_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert "#SBATCH --nodes=" in SCRIPT.read_text()


def test_slurm_example_launches_a_valid_multinode_run(tmp_path):
    launcher, flags = _launch(tmp_path, "--global-batch-size", "128")
    pairs = dict(zip(launcher[::2], launcher[1::2]))
    assert pairs == {"--nnodes": "2", "--nproc-per-node": "8", "--rdzv-backend": "c10d",
                     "--rdzv-endpoint": "gpu-07:29500", "--rdzv-id": "4242"}
    config = parse_config(flags)
    assert config.dataset.data_cache_path == "/local/scratch/megatron-index-cache-4242"  # the node's own disk
    assert config.distributed.distributed_timeout_minutes == 10
    assert config.batch_size.global_batch_size == 128  # the sbatch arguments reach pretrain_gpt.py, last
    assert validate(config, world_size=16, cuda_available=True) == []
    assert config.distributed.dp_degree == 16 and config.watchdog_timeout_minutes == 10

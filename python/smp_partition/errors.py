"""Exceptions of smp_partition."""

from __future__ import annotations


class SmpError(RuntimeError):
    """A step of smp_partition failed; the message names the cause and the fix."""


class ExportError(SmpError):
    """`torch.onnx.export` could not capture the model: the message names the module and the
    construct it stopped on; the exporter's own error is the `__cause__`."""


class CommandError(SmpError):
    """A binary exited with an error.

    Attributes: `command` (the argument list), `returncode`, `stderr` (its last lines)."""

    def __init__(self, command: list[str], returncode: int, stderr: str):
        self.command = command
        self.returncode = returncode
        self.stderr = stderr
        tail = stderr.strip().splitlines()[-20:]
        super().__init__(f"`{' '.join(command[:2])} …` exited with status {returncode}:\n" + "\n".join(tail))


class RankFailed(SmpError):
    """A rank of `launch` failed; the others were stopped.

    Attributes: `rank` (global rank), `how` (e.g. "was killed by SIGKILL"), `log` (the run's
    last stderr lines)."""

    def __init__(self, rank: int, how: str, log: str):
        self.rank = rank
        self.how = how
        self.log = log
        super().__init__(f"rank {rank} {how}; the other ranks were stopped\n" + "\n".join(log.strip().splitlines()[-20:]))

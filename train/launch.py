"""torchrun whose last line is the trainer's own error: `python -m train.launch` takes torchrun's
arguments and runs its agent in this process,

    .venv/bin/python -m train.launch --standalone --nproc_per_node=2 -m train.trainer.grpo --config-name stub ...

When the ranks stop on an error they wrote down (`error: ...`: config, data, env module, disk,
weight sync), torchrun's ChildFailedError traceback and banner would bury that line; here it comes
last and the exit code is the rank's (2: a mistake to fix, 4: a runtime failure). Any other failure
keeps torchrun's full report.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from train.utils.torchrun_errors import recorded_line


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except ChildFailedError as e:
        root_rank, root = e.get_first_failure()
        lines: list[str] = []
        for _, failure in sorted(e.failures.items()):
            line = recorded_line(failure.message)
            if line is not None and line not in lines:
                lines.append(line)
        if not lines:
            raise
        print("\n".join(lines), file=sys.stderr, flush=True)
        return root.exitcode if root.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

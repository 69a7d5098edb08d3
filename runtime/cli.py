"""The command-line entry of the applications' commands (converters, evals): a user's mistake is one line."""

from __future__ import annotations

import sys


def run_cli(prog: str, fn, *args, interrupted: str = "") -> int:
    """Run a command's work ``fn(*args)``: 0 when it returns; a bad input (``ValueError`` and its subclasses,
    the commands' one-message errors) or a file it cannot read or write (``OSError``: a missing input, no
    permission, a full disk) is one ``<prog>: error: ...`` line on stderr and exit code 2, with no traceback;
    Ctrl-C is one ``<prog>: interrupted (Ctrl-C)`` line (``interrupted``: what that leaves, appended) and exit
    code 130. Known third-party warnings are one line (``data.third_party_noise``)."""
    from runtime.megatron_cpu import lean_megatron_import
    from runtime.process_exit import freeze_at_exit
    from data.third_party_noise import quiet_third_party

    freeze_at_exit()
    quiet_third_party()
    lean_megatron_import()
    try:
        fn(*args)
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (Ctrl-C){': ' + interrupted if interrupted else ''}", file=sys.stderr)
        return 130
    return 0

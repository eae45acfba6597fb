"""Run a script with some of nbflash.configs' planning constants set for this run only: an option
timed against the plan without editing configs.py.

    python scripts/with_configs.py NAME=VALUE [NAME=VALUE ...] -- SCRIPT [ARGUMENTS ...]

VALUE is "on" or "off" (True, False) or a Python literal (1e9, 3, "red"). scripts/gpu_check.sh's
modes run bench.py and sm90_schedules.py this way, each setting in its own process.
"""

import ast
import os
import runpy
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse_value(text):
    """``on``/``off`` as True/False, else a Python literal."""
    if text in ("on", "off"):
        return text == "on"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise SystemExit(f"with_configs.py: value {text!r} is neither on, off nor a Python literal") from None


def main(argv):
    if "--" not in argv:
        raise SystemExit(__doc__)
    split = argv.index("--")
    settings, command = argv[:split], argv[split + 1:]
    if not command:
        raise SystemExit("with_configs.py: no script after '--'")
    from nbflash import configs

    for setting in settings:
        name, sep, text = setting.partition("=")
        if not sep or not hasattr(configs, name):
            raise SystemExit(f"with_configs.py: {setting!r} is not NAME=VALUE for a constant of nbflash.configs")
        setattr(configs, name, parse_value(text))
    sys.argv = command
    runpy.run_path(command[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])

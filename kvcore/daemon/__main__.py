"""``python -m kvcore.daemon ARGS``: the serve command alone (what DaemonProcess runs)."""

import argparse
import sys

from kvcore.daemon.serve import add_arguments, main

parser = argparse.ArgumentParser(prog="kvcore serve")
add_arguments(parser)
sys.exit(main(parser.parse_args()))

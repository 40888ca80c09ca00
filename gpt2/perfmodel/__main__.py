"""Entry point: python -m gpt2.perfmodel (see cli.py)."""
import sys

from .cli import main

sys.exit(main())

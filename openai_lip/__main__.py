"""`python -m openai_lip`: the OpenAI LIP (server.py).

The program never forks or execs, and locks itself so (seccomp) before loading
anything else, as `lip run --sandbox` locks a `.py` program before its first line: it
reads untrusted request bodies.
"""
from liblip.sandbox.seccomp import lock_python_program

lock_python_program()

from openai_lip.server import main  # noqa: E402

main()

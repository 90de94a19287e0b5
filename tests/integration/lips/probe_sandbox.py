"""A LIP that probes its sandbox: pred must work; each other line says what the
sandbox allowed or denied (with the errno)."""
import os
import socket
import threading

import liblip as lip

kv = lip.kv_create()
d = lip.pred(kv, lip.tokenize("Hello"))
print("pred ok", d.argmax())
probes = [
    ("write /etc", lambda: open("/etc/lip-sandbox-probe", "w")),
    ("write cwd repo", lambda: open(os.path.join(os.environ["PROBE_REPO"], "probe"), "w")),
    ("write scratch", lambda: open(os.path.join(os.environ["HOME"], "f"), "w").write("x")),
    ("inet socket", lambda: socket.socket(socket.AF_INET)),
    ("fork", lambda: os.fork()),
    ("exec", lambda: os.execv("/bin/true", ["true"])),
]
for what, probe in probes:
    try:
        result = probe()
        if what == "fork" and result == 0:
            os._exit(0)
        print(what, "allowed")
    except OSError as exc:
        print(what, "denied", exc.errno)
t = threading.Thread(target=lambda: print("thread ok"))
t.start()
t.join()
# memfd_create is refused here: no logits buffer, raw rows come as frames (pred ok above)
print("logits buffer", lip.client().logits is not None)

#!/bin/bash
# A hostile shell LIP for the sandbox tests: for each attack named in the arguments,
# print `NAME rc=STATUS` (0: the attack worked). Absolute paths among the arguments are
# not attacks (the sandbox exposes them); NAME=VALUE passes a path.
for arg in "$@"; do
  name=${arg%%=*} value=${arg#*=}
  case $name in
    /*) continue ;;
    uid) echo "uid $(id -u)"; true ;;
    inet-loopback) (exec 3<>/dev/tcp/127.0.0.1/9) 2>/dev/null ;;
    write-etc) (echo x >/etc/lip-hostile) 2>/dev/null ;;
    write-host-tmp) (echo x >/tmp/lip-hostile) 2>/dev/null ;;
    write-scratch) (echo x >"$HOME/f") 2>/dev/null ;;
    write) (echo x >"$value") 2>/dev/null ;;
    read-shadow) cat /etc/shadow >/dev/null 2>&1 ;;
    read) cat "$value" >/dev/null 2>&1 ;;
    run-written-binary) cp /bin/true "$HOME/t" && chmod +x "$HOME/t" && "$HOME/t" 2>/dev/null ;;
    ldso-written-binary) cp /bin/true "$HOME/t" && $(ls /lib64/ld-linux-x86-64.so.2 /lib/ld-linux-aarch64.so.1 2>/dev/null | head -1) "$HOME/t" 2>/dev/null ;;
    run-system-binary) /bin/true ;;
    kill) kill -0 "$value" 2>/dev/null ;;
    fork-bomb) echo "fork-bomb started"; bomb() { bomb | bomb & }; while :; do bomb; done 2>/dev/null ;;
    *) echo "unknown attack $name" >&2; exit 2 ;;
  esac
  echo "$name rc=$?"
done

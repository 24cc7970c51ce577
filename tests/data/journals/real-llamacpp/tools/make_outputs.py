"""Write the recorded llama-server journals as corpus files, xz'd exports and INDEX.tsv rows.

Usage: python3 make_outputs.py DEST RUNDIR...   (the run_llamacpp.py outdirs, in run order)
Each scenario NN (01-22) becomes DEST/3(NN+39)-real-llamacpp-SLUG.log (340-361) and
DEST/NN-SLUG.export.xz; the controls only an export. Labels come from run_llamacpp.LABELS;
every root_cause_key is checked to occur in its .log; `ended` is read from PID 1's
"Main process exited" line of the first invocation.
"""

from __future__ import annotations

import lzma
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_llamacpp import LABELS  # noqa: E402

VERSION = ("llama.cpp ggml-org/llama.cpp@0c1e57098 (vendored in the llama-cpp-python 0.3.36 "
           "sdist; `llama-server --version`: 0.5.0-dev (build 1, commit 0c1e570)), CPU-only "
           "static build, GNU 12.2.0, -DGGML_NATIVE=OFF; systemd 252.39")
SRC = "recorded here"
# the first invocation's lines of 17 carry no _SYSTEMD_INVOCATION_ID (see README-section.md):
# its .log is `journalctl _PID=<first main PID> -o cat --all` of that invocation instead.
FIRST_BY_PID = {"17-device-not-found": "782"}


def lines_of_pid(export: bytes, pid: str) -> bytes:
    """`journalctl _PID=pid -o cat --all` of an export (via systemd-journal-remote)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "x.export").write_bytes(export)
        subprocess.run(["/lib/systemd/systemd-journal-remote", "-o", f"{tmp}/x.journal",
                        f"{tmp}/x.export"], check=True, capture_output=True)
        return subprocess.run(["journalctl", "--file", f"{tmp}/x.journal", f"_PID={pid}", "-o",
                               "cat", "--all"], check=True, capture_output=True).stdout

# name -> (root_cause_key, class hint, phase, served_s, notes)
ROWS: dict[str, tuple[str, str, str, str, str]] = {
    "01-model-file-missing": (
        "failed to open GGUF file '/models/nope.gguf' (No such file or directory)",
        "local_model_path_missing", "startup", "",
        "`-m /models/nope.gguf`. The key line comes twice (the memory-fit pass, then the real "
        "load), each followed by generic 'failed to load model' wrappers; last line 'exiting "
        "due to model loading error'."),
    "02-gguf-truncated": (
        "tensor 'token_embd.weight' data is not within the file bounds, model is corrupted or "
        "incomplete", "corrupted_weights_file", "startup", "",
        "a copy of the tiny GGUF cut with `truncate -s 1000000` (header intact, tensor data "
        "short)."),
    "03-not-a-gguf-safetensors": (
        "invalid magic characters: '????', expected 'GGUF'", "model_format_not_gguf",
        "startup", "", "`-m` a HF model.safetensors (not GGUF); the first 4 bytes (the "
        "safetensors header length) are printed as literal '????'."),
    "04-cli-unknown-flag": (
        "error: invalid argument: --foo", "cli_usage_error", "startup", "",
        "`--foo`: the whole invocation is this one line (no usage text), exit 1 (not 2)."),
    "05-cli-ctx-size-not-a-number": (
        'error while handling argument "--ctx-size": stoi', "invalid_cli_flag_value", "startup",
        "", "`--ctx-size abc`: the C++ exception text 'stoi' is all it says, then the flag's "
        "usage."),
    "06-port-in-use": (
        "couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 18106", "port_in_use",
        "startup", "",
        "a unit `python3 -m http.server 18106 --bind 127.0.0.1` held the port for all 3 starts. "
        "The line gives no errno: the same words as 14 (address not on the host) and 12 (held "
        "briefly). 'either': it fails while the other process holds the port."),
    "07-lora-file-missing": (
        "llama_adapter_lora_init: failed to open '/models/nope-lora.gguf': No such file or "
        "directory", "lora_adapter_missing", "startup", "",
        "`--lora /models/nope-lora.gguf`; the model loads first, then the adapter fails."),
    "08-chat-template-file-missing": (
        "error while handling argument \"--chat-template-file\": error: failed to open file "
        "'/nope.jinja'", "cli_usage_error", "startup", "",
        "`--chat-template-file /nope.jinja`: an argument-parsing error, then 15 lines of that "
        "flag's usage (the list of built-in templates)."),
    "09-ctx-size-beyond-memory": (
        "insufficient memory (attempted to allocate 195312.50 MB)", "kv_cache_no_memory",
        "startup", "",
        "`--ctx-size 100000000` (KV cache 195 GB on a 24 GiB host). A WARNING first "
        "('common_fit_params: failed to fit params ... abort', ~3 s), then the allocation "
        "fails: 'failed to allocate buffer for kv cache'; exit 1 ~6 s after start. "
        "(--ctx-size 2000000000 instead was OOM-killed by the kernel on a host trial: not "
        "recorded.)"),
    "10-main-sigkill-serving": (
        "", "", "serving", "11",
        "served (/health 200, one /completion 200), idle 10 s, then `kill -9` of the main PID "
        "from inside the container, 3 times. The service writes nothing at all about it: the "
        "last line is the completion's 'slot release'; PID 1: 'Main process exited, "
        "code=killed, status=9/KILL', 'Failed with result 'signal''; Restart=always "
        "restarted it and it served again. served_s: 'listening on' to PID 1's exit line."),
    "11-model-permission-denied": (
        "failed to open GGUF file '/var/tmp/llamacpp-real/models/tiny-private.gguf' "
        "(Permission denied)", "model_file_permission_denied", "startup", "",
        "User=nobody; the model copy is 0600 root."),
    "12-port-held-briefly": (
        "couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 18112", "port_in_use",
        "startup", "",
        "a unit `python3 -m http.server 18112` held the port for the first start only; it was "
        "stopped after that crash, and the restart served (/health 200) until the driver's "
        "stop (export: 2 invocations). The .log is the failed first start: the same lines as "
        "06."),
    "13-architecture-unknown": (
        "unknown model architecture: 'qwen9'", "unsupported_architecture", "startup", "",
        "a copy of the tiny GGUF whose general.architecture and llama.* keys were renamed "
        "'qwen9' in place (tools/make_arch_unknown.py): a model newer than the build."),
    "14-host-address-not-local": (
        "couldn't bind HTTP server socket, hostname: 10.255.255.1, port: 18115",
        "bind_address_not_local", "startup", "",
        "`--host 10.255.255.1`, an address the host does not have. The same words as a port "
        "in use (06): no errno."),
    "15-mmproj-file-missing": (
        "failed to open GGUF file '/models/nope-mmproj.gguf' (No such file or directory)",
        "local_model_path_missing", "startup", "",
        "`--mmproj /models/nope-mmproj.gguf`: first a fit-pass error, then the model loads, "
        "then 'clip_model_loader: failed to load CLIP model ... Does this file exist?' and "
        "'failed to load multimodal model'."),
    "16-model-path-is-directory": (
        "gguf_init_from_reader: failed to read magic", "model_format_not_gguf", "startup", "",
        "`-m` the HF checkout directory. No line says it is a directory."),
    "17-device-not-found": (
        'error while handling argument "--device": invalid device: CUDA0',
        "cuda_device_unavailable", "startup", "",
        "`--device CUDA0` on a CPU-only build. The first invocation's 7 lines were journaled "
        "WITHOUT _SYSTEMD_INVOCATION_ID (it exited in ~20 ms); they still carry _SYSTEMD_UNIT. "
        "This .log is `journalctl _PID=782 -o cat --all` of that invocation (byte-identical to "
        "the 2nd's, which has an id)."),
    "18-tensor-shape-mismatch": (
        "tensor 'blk.0.attn_q.weight' has wrong shape", "weight_shape_mismatch", "startup", "",
        "a copy of the tiny GGUF with llama.attention.head_count set to 3 (was 4) in place: "
        "'check_tensor_dims: ... expected 256, 192, got 256, 256, 1, 1'."),
    "19-ggml-assert-batch-size-1": (
        "GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max) failed", "ggml_assert_abort",
        "startup", "",
        "`-b 1 -ub 1`: an internal assert while the memory-fit pass builds a context; ggml "
        "prints a gdb backtrace (gdb is on the host /usr), then abort: PID 1 'code=killed, "
        "status=6/ABRT' (no core: the unit's core limit). The assert line carries the build "
        "directory's path."),
    "20-env-ctx-size-not-a-number": (
        'error while handling environment variable "LLAMA_ARG_CTX_SIZE": stoi',
        "invalid_cli_flag_value", "startup", "",
        "Environment=LLAMA_ARG_CTX_SIZE=abc in the unit; one line, exit 1."),
    "21-ssl-not-built": (
        "the server is built without SSL support", "build_feature_missing", "startup", "",
        "`--ssl-key-file ... --ssl-cert-file ...` (files that do not exist) on a build "
        "without OpenSSL: it says so before looking at the files."),
    "22-binary-missing": (
        "Failed to locate executable /usr/local/bin/llama-server: No such file or directory",
        "binary_missing", "startup", "",
        "ExecStart=/usr/local/bin/llama-server (no such file). Both lines come from systemd's "
        "forked child ('(a-server)'), not PID 1 and not llama.cpp; PID 1: 'status=203/EXEC'."),
}
ORDER = list(ROWS)
HEADER = ("file\texpected_severity\troot_cause_key\tclass\tsource_url\tversion\tnotes\tengine"
          "\tphase\tserved_s\tended")


def entries(export: bytes) -> list[dict[bytes, bytes]]:
    out = []
    for ent in export.split(b"\n\n"):  # text fields only; binary ones are skipped here
        f = dict(line.split(b"=", 1) for line in ent.split(b"\n") if b"=" in line)
        if f:
            out.append(f)
    return out


def ended(export: bytes) -> str:
    for f in entries(export):
        m = re.search(rb"Main process exited, code=(\w+), status=(\d+)", f.get(b"MESSAGE", b""))
        if f.get(b"_PID") == b"1" and m:
            return f"{m[1].decode()}:{m[2].decode()}"
    return "exited:0"  # systemd 252 logs no 'Main process exited' for status 0


def main() -> None:
    dest, runs = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    dest.mkdir(parents=True, exist_ok=True)
    rows = [HEADER]
    names = ORDER + ["control-clean-stop", "control-main-sigterm-serving"]
    for name in names:
        run = next(r for r in runs if (r / f"{name}.export").exists())
        export = (run / f"{name}.export").read_bytes()
        (dest / f"{name}.export.xz").write_bytes(lzma.compress(export))
        if name not in ROWS:
            continue
        nn = int(name[:2])
        slug = name[3:]
        logname = f"{nn + 339}-real-llamacpp-{slug}.log"
        if name in FIRST_BY_PID:
            text = lines_of_pid(export, FIRST_BY_PID[name])
        else:
            text = (run / f"{name}.log").read_bytes()
        (dest / logname).write_bytes(text)
        key, cls, phase, served, notes = ROWS[name]
        assert key == "" or key.encode() in text, (name, key)
        sev, reason = LABELS[name]
        n = text.count(b"\n")
        note = (f"Label {sev} before recording: {reason}. {notes} {n} lines; 3 invocations "
                f"(export {name}.export.xz).")
        if name == "12-port-held-briefly":
            note = note.replace("3 invocations", "2 invocations")
        del cls  # kept above as a hint; the column stays empty, as for real-vllm batches 2-3
        rows.append("\t".join([logname, sev, key, "", SRC, VERSION, note, "other", phase,
                               served, ended(export)]))
    (dest / "INDEX-rows.tsv").write_text("\n".join(rows) + "\n")
    print(f"{len(rows) - 1} rows")


if __name__ == "__main__":
    main()

"""A realistic vLLM journal of N entries, written by systemd-journal-remote and cached by N.

What is in it (all of vllm.service unless said otherwise):
- a long serving invocation: startup lines, tqdm weight-loading bars rewritten with `\\r` (stored
  as binary fields), then request logs (`Received request`, `Added request`, uvicorn access lines)
  with an engine stats line (`Avg prompt throughput: ... GPU KV cache usage: ...`) every ~20
  lines, a warning now and then, a long line (5-20 KiB) every ~5000 lines, one 1 MB line and a
  line with non-UTF-8 bytes every ~2000 lines; it ends with a clean stop;
- ~2 % entries of other units (sshd, cron) interleaved, which the unit filter must skip;
- at the end a crash loop: CRASHES invocations crashing on the seed flashinfer traceback, each
  with PID 1's exit / failed / restart messages (`supervisor.journal.writer.crashed_invocation`).

Every entry carries the trusted fields journald adds to a service's stdout (`_UID`, `_CMDLINE`,
`_SYSTEMD_CGROUP`, `_STREAM_ID`, ...), so readers that output every field pay for them as they
would on a real host. Timestamps advance 2 ms per entry from a fixed point in the past.

The bulk is encoded here (the constant fields of an invocation are encoded once) because
`writer.export_entry` checks every byte in Python and would make a 10M-entry journal take minutes;
the output is the same export format, piped into the same journal-remote binary.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from vllm_supervisor.journal.writer import JOURNAL_REMOTE, FieldValue, crashed_invocation

UNIT = "vllm.service"
CRASHES = 5
GENERATOR_VERSION = 2  # bump when the content changes: the cache is keyed by it
STEP_US = 2000
REPO = Path(__file__).resolve().parent.parent
SEED_CANDIDATES = (
    REPO / "supervisor" / "data" / "seed-flashinfer-crash.log",
    REPO / "tests" / "e2e" / "data" / "flashinfer-crash.log",
)
_NOT_TEXT = re.compile(rb"[\x00-\x08\x0a-\x1f]")


@dataclass(frozen=True, slots=True, kw_only=True)
class Journal:
    """A generated journal directory and what was written into it."""

    directory: Path
    entries: int  # entries written, all units
    unit_entries: int  # entries `journalctl -u vllm.service` returns
    crashes: int  # crashed invocations of vllm.service
    seconds: float  # time it took to generate (0 when cached)
    bytes_on_disk: int


def cache_root() -> Path:
    """Where generated journals are kept between runs."""
    return Path(tempfile.gettempdir()) / "vllm-supervisor-bench"


def seed_lines() -> list[str]:
    """The flashinfer crash the crash loop repeats."""
    for path in SEED_CANDIDATES:
        if path.exists():
            return path.read_text(encoding="utf-8").splitlines()
    return [
        "(EngineCore_DP0 pid=4300) ERROR 11-30 09:12:31 [core.py:708] Traceback "
        "(most recent call last):",
        '(EngineCore_DP0 pid=4300) ERROR 11-30 09:12:31 [core.py:708]   File "/opt/vllm/lib/'
        'python3.12/site-packages/flashinfer/__init__.py", line 23, in <module>',
        "(EngineCore_DP0 pid=4300) ERROR 11-30 09:12:31 [core.py:708] RuntimeError: "
        "flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4)",
    ]


def journal_for(entries: int, *, root: Path | None = None, log: bool = True) -> Journal:
    """The cached journal of `entries` entries, generating it when missing."""
    base = (root or cache_root()) / f"journal-{entries}-v{GENERATOR_VERSION}"
    meta = base / "meta.json"
    if meta.exists():
        data = json.loads(meta.read_text())
        return Journal(
            directory=base / "journal",
            entries=data["entries"],
            unit_entries=data["unit_entries"],
            crashes=data["crashes"],
            seconds=0.0,
            bytes_on_disk=data["bytes_on_disk"],
        )
    shutil.rmtree(base, ignore_errors=True)
    directory = base / "journal"
    directory.mkdir(parents=True)
    if log:
        print(f"generating a journal of {entries:,} entries in {directory} ...", flush=True)
    started = time.perf_counter()
    written, unit_entries = write_journal(directory, entries)
    seconds = time.perf_counter() - started
    size = sum(p.stat().st_size for p in directory.iterdir())
    meta.write_text(
        json.dumps(
            {
                "entries": written,
                "unit_entries": unit_entries,
                "crashes": CRASHES,
                "bytes_on_disk": size,
                "generator_version": GENERATOR_VERSION,
            }
        )
    )
    if log:
        print(f"  {written:,} entries, {size / 1e6:.0f} MB, {seconds:.1f} s", flush=True)
    return Journal(
        directory=directory,
        entries=written,
        unit_entries=unit_entries,
        crashes=CRASHES,
        seconds=seconds,
        bytes_on_disk=size,
    )


def write_journal(directory: Path, entries: int) -> tuple[int, int]:
    """Write the whole journal through journal-remote; (entries, vllm.service entries)."""
    remote = start_remote(directory)
    assert remote.stdin is not None
    encoder = Encoder(start_us=int((time.time() - 86400 * 2) * 1e6))
    crash_entries = [
        fields
        for restart in range(CRASHES)
        for fields in crashed_invocation(
            UNIT, seed_lines(), restarts=restart + 1, pid=7000 + restart
        )
    ]
    serving = max(0, entries - len(crash_entries))
    unit_count = 0
    chunk: list[bytes] = []
    for data, own in serving_invocation(encoder, serving):
        chunk.append(data)
        unit_count += own
        if len(chunk) >= 4096:
            remote.stdin.write(b"".join(chunk))
            chunk.clear()
    for fields in crash_entries:
        chunk.append(encoder.entry(fields))
        unit_count += 1
    remote.stdin.write(b"".join(chunk))
    finish_remote(remote)
    return encoder.seqnum, unit_count


def start_remote(directory: Path) -> subprocess.Popen[bytes]:
    """systemd-journal-remote appending export format from its stdin to `directory`."""
    binary = shutil.which(JOURNAL_REMOTE) or shutil.which("systemd-journal-remote")
    if binary is None:
        raise SystemExit(f"{JOURNAL_REMOTE} not found: apt-get install systemd-journal-remote")
    directory.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [binary, f"--output={directory / 'remote.journal'}", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def finish_remote(remote: subprocess.Popen[bytes]) -> None:
    """Close journal-remote's input and wait for it to finish the file."""
    assert remote.stdin is not None
    assert remote.stderr is not None
    remote.stdin.close()
    stderr = remote.stderr.read()
    remote.wait(timeout=600)
    if remote.returncode != 0:
        raise SystemExit(f"journal-remote failed: {stderr.decode(errors='replace')[-500:]}")


class Encoder:
    """Journal export format with journald's trusted fields; the constant part encoded once."""

    def __init__(self, *, start_us: int, step_us: int = STEP_US) -> None:
        self.step_us = step_us
        self.boot_id = uuid.uuid4().hex
        self.seqnum_id = uuid.uuid4().hex
        self.machine_id = uuid.uuid4().hex
        self.clock_us = self.start_us = start_us
        self.seqnum = 0
        self._boot = f"_BOOT_ID={self.boot_id}\n_MACHINE_ID={self.machine_id}\n".encode()

    def head(self, now_us: int | None = None) -> bytes:
        """The cursor, timestamps and boot id of the next entry."""
        self.seqnum += 1
        self.clock_us = max(self.clock_us + self.step_us, now_us or 0)
        monotonic = self.clock_us - self.start_us  # the clock never steps here
        return (
            f"__CURSOR=s={self.seqnum_id};i={self.seqnum:x};b={self.boot_id};"
            f"m={monotonic:x};t={self.clock_us:x};x=0\n"
            f"__REALTIME_TIMESTAMP={self.clock_us}\n__MONOTONIC_TIMESTAMP={monotonic}\n"
        ).encode() + self._boot

    def entry(self, fields: Mapping[str, FieldValue], *, now_us: int | None = None) -> bytes:
        """One whole entry from a field mapping (the slow, general path)."""
        return self.head(now_us) + encode_fields(fields) + b"\n"

    def line(self, constant: bytes, message: bytes, *, now_us: int | None = None) -> bytes:
        """One entry of a service's stdout: pre-encoded constant fields plus MESSAGE."""
        return self.head(now_us) + constant + encode_field("MESSAGE", message) + b"\n"


def encode_field(key: str, raw: bytes) -> bytes:
    """`KEY=VALUE\\n`, or the binary form when the value holds control characters."""
    if _NOT_TEXT.search(raw):
        return key.encode() + b"\n" + len(raw).to_bytes(8, "little") + raw + b"\n"
    return key.encode() + b"=" + raw + b"\n"


def encode_fields(fields: Mapping[str, FieldValue]) -> bytes:
    """Every field of a mapping in export format."""
    return b"".join(
        encode_field(k, v if isinstance(v, bytes) else str(v).encode()) for k, v in fields.items()
    )


def stdout_fields(unit: str, invocation_id: str, pid: int, *, comm: str, cmdline: str) -> bytes:
    """What journald stores with every line a unit writes to stdout (systemd 252)."""
    name = unit.rsplit(".", 1)[0]
    return encode_fields(
        {
            "_TRANSPORT": "stdout",
            "PRIORITY": 6,
            "SYSLOG_FACILITY": 3,
            "SYSLOG_IDENTIFIER": name,
            "_UID": 998,
            "_GID": 998,
            "_COMM": comm,
            "_EXE": "/opt/vllm/bin/python3.12" if comm == "python3" else f"/usr/sbin/{comm}",
            "_CMDLINE": cmdline,
            "_CAP_EFFECTIVE": 0,
            "_SYSTEMD_CGROUP": f"/system.slice/{unit}",
            "_SYSTEMD_UNIT": unit,
            "_SYSTEMD_SLICE": "system.slice",
            "_SYSTEMD_INVOCATION_ID": invocation_id,
            "_STREAM_ID": uuid.uuid4().hex,
            "_HOSTNAME": "gpu-node-07",
            "_PID": pid,
        }
    )


_TEXT = (
    "the quick brown fox jumps over a lazy dog summarize this document in three bullet points "
    "translate to French explain quantum entanglement like I am five write a haiku about GPUs "
    "what is the capital of Australia list prime numbers below one hundred refactor this code"
)
_WORDS = tuple(_TEXT.split(" "))


def serving_invocation(encoder: Encoder, count: int) -> Iterator[tuple[bytes, int]]:
    """(entry bytes, 1 if it belongs to vllm.service) for a long serving invocation."""
    rnd = random.Random(count)
    inv = uuid.uuid4().hex
    api_pid, core_pid = 3100, 3187
    cmdline = (
        "/opt/vllm/bin/python3 -m vllm.entrypoints.openai.api_server --model "
        "meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 1 --port 8000"
    )
    api = stdout_fields(UNIT, inv, api_pid, comm="python3", cmdline=cmdline)
    core = stdout_fields(UNIT, inv, core_pid, comm="python3", cmdline=cmdline)
    others = [
        stdout_fields("sshd.service", uuid.uuid4().hex, 812, comm="sshd", cmdline="sshd: -D"),
        stdout_fields("cron.service", uuid.uuid4().hex, 640, comm="cron", cmdline="/usr/sbin/cron"),
    ]
    if count <= 0:
        return
    lifecycle = {
        "_PID": 1,
        "_SYSTEMD_UNIT": "init.scope",
        "SYSLOG_IDENTIFIER": "systemd",
        "_TRANSPORT": "journal",
        "PRIORITY": 6,
        "UNIT": UNIT,
        "INVOCATION_ID": inv,
    }
    yield (
        encoder.entry(
            {
                **lifecycle,
                "MESSAGE_ID": "39f53479d3a045ac8e11786248231fbf",
                "MESSAGE": f"Started {UNIT}.",
                "JOB_RESULT": "done",
            }
        ),
        1,
    )
    produced = 1
    tail = 2  # the clean stop at the end

    def stamp() -> str:
        ts = time.gmtime(encoder.clock_us / 1e6)
        return time.strftime("%m-%d %H:%M:%S", ts)

    def api_line(text: str, level: str = "INFO") -> bytes:
        return f"(APIServer pid={api_pid}) {level} {stamp()} {text}".encode()

    startup = [
        api_line("[api_server.py:1839] vLLM API server version 0.11.0"),
        api_line("[utils.py:233] non-default args: {'model': 'meta-llama/Llama-3.1-8B-Instruct'}"),
        f"(EngineCore_DP0 pid={core_pid}) INFO {stamp()} [core.py:77] Initializing a V1 LLM "
        "engine (v0.11.0) with config: model='meta-llama/Llama-3.1-8B-Instruct'".encode(),
    ]
    bars = []
    for total in (4, 4):
        states = [
            f"Loading safetensors checkpoint shards: {100 * k // total:3d}% Completed | "
            f"{k}/{total} [00:{k:02d}<00:{total - k:02d},  1.02s/it]"
            for k in range(total + 1)
        ]
        bars.append(f"(EngineCore_DP0 pid={core_pid}) " + "\r".join(states) + "\r")
    startup += [bar.encode() for bar in bars]
    for message in startup:
        if produced >= count - tail:
            break
        yield encoder.line(core if b"EngineCore" in message else api, message), 1
        produced += 1
    big_done = False
    n = 0
    while produced < count - tail:
        n += 1
        roll = rnd.random()
        if roll < 0.02:
            yield encoder.line(others[n % 2], f"session opened for user deploy{n % 7}".encode()), 0
        elif n % 20 == 0:
            running = rnd.randint(0, 12)
            yield (
                encoder.line(
                    api,
                    api_line(
                        f"[loggers.py:123] Engine 000: Avg prompt throughput: "
                        f"{rnd.uniform(0, 9000):.1f} tokens/s, Avg generation throughput: "
                        f"{rnd.uniform(0, 2000):.1f} tokens/s, Running: {running} reqs, "
                        f"Waiting: 0 reqs, GPU KV cache usage: {rnd.uniform(0, 90):.1f}%, "
                        f"Prefix cache hit rate: {rnd.uniform(0, 80):.1f}%"
                    ),
                ),
                1,
            )
        elif not big_done and produced >= count // 2:
            big_done = True
            prompt = "x" * (1 << 20)
            yield encoder.line(api, api_line(f"[logger.py:43] Received request big: {prompt}")), 1
        elif n % 5000 == 0:
            prompt = " ".join(rnd.choices(_WORDS, k=rnd.randint(900, 3500)))
            yield (
                encoder.line(api, api_line(f"[logger.py:43] Received request long: {prompt!r}")),
                1,
            )
        elif n % 2000 == 0:
            message = api_line("[logger.py:43] Received request bad: prompt: '") + (
                b"caf\xe9 \xff\xfe r\xc3sum\xe9'"
            )
            yield encoder.line(api, message), 1
        elif n % 997 == 0:
            yield (
                encoder.line(
                    api,
                    api_line(
                        "[serving_chat.py:211] Error in preprocessing prompt inputs: "
                        "max_tokens exceeds the context window",
                        "WARNING",
                    ),
                ),
                1,
            )
        else:
            kind = n % 3
            req = f"chatcmpl-{rnd.getrandbits(128):032x}"
            if kind == 0:
                prompt = " ".join(rnd.choices(_WORDS, k=rnd.randint(5, 40)))
                text = (
                    f"[logger.py:43] Received request {req}: prompt: {prompt!r}, params: "
                    f"SamplingParams(n=1, temperature={rnd.choice((0.0, 0.7, 1.0))}, top_p=1.0, "
                    f"max_tokens={rnd.choice((128, 256, 512, 1024))}), prompt_token_ids: None, "
                    "lora_request: None."
                )
                yield encoder.line(api, api_line(text)), 1
            elif kind == 1:
                yield encoder.line(api, api_line(f"[async_llm.py:255] Added request {req}.")), 1
            else:
                port = rnd.randint(30000, 65000)
                text = (
                    f'(APIServer pid={api_pid}) INFO:     10.0.{n % 5}.{n % 250}:{port} - "POST '
                    '/v1/chat/completions HTTP/1.1" 200 OK'
                )
                yield encoder.line(api, text.encode()), 1
        produced += 1
    for event, message in (
        ("9d1aaa27d60140bd96365438aad20286", f"Stopping {UNIT}..."),
        ("7ad2d189f7e94e70a38c781354912448", f"{UNIT}: Deactivated successfully."),
    ):
        yield encoder.entry({**lifecycle, "MESSAGE_ID": event, "MESSAGE": message}), 1

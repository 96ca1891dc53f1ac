"""Guardrails for agent commands under `egress run`: the command deny list, output caps, --agent.

Tables of real cases for the deny list (pure: egress.agent.commands), then real `egress run`
processes (both front ends: click's `egress.cli` and the click-free `egress` entry) running
real shells and real commands that print large outputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env

from egress.agent.commands import builtin_rules, check, commands, compile_rule
from egress.agent.output_cap import CappedStream, parse_size
from egress.scan.detect import Detector, StreamRedactor

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")

BUILTIN = builtin_rules()

# ------------------------------------------------------------ the deny list: tables

# Commands that must never be refused: the dangerous words are arguments, data, comments,
# quoted text, heredoc bodies or case patterns, not commands.
MUST_PASS = [
    ["grep", "-r", "sudo", "."],
    ["sh", "-c", 'grep -r "sudo" .'],
    ["sh", "-c", 'echo "shutdown" >> notes.txt'],
    ["bash", "-c", "echo 'rm -rf /' > notes.txt"],
    ["sh", "-c", "git commit -m 'sudo make me a sandwich; reboot'"],
    ["sh", "-c", "echo sudo | tr a-z A-Z"],
    ["sh", "-c", "cat <<EOF\nsudo reboot\nrm -rf /\nEOF\necho ok"],
    ["sh", "-c", "cat <<-'END'\n\tshutdown now\n\tEND\necho ok"],
    ["sh", "-c", "case $x in reboot) echo r;; halt|poweroff) echo h;; esac"],
    ["sh", "-c", "# sudo reboot\necho hi"],
    ["sh", "-c", "x=$((3 + 4)); echo $x"],
    ["sh", "-c", "ls 2>&1 | grep sudo"],
    ["sh", "-c", "dd if=/dev/zero of=./disk.img bs=1M count=10"],
    ["sh", "-c", "dd if=/dev/sda of=backup.img"],
    ["rm", "-rf", "/tmp/build"], ["rm", "-rf", "build/"], ["sh", "-c", "rm -rf ./node_modules ~/.cache/x"],
    ["rm", "/"],  # not recursive: rm refuses a folder anyway
    ["chmod", "-R", "755", "./build"], ["chmod", "777", "/"],
    ["sudoku"], ["make", "reboot"], ["echo", "rm -rf /"], ["python3", "-c", "print('sudo')"],
    ["man", "shutdown"], ["which", "sudo"], ["apt-cache", "show", "sudo"], ["pip", "download", "su"],
    ["sh", "-c", "journalctl | grep -i reboot"], ["sh", "-c", "printf '%s\\n' mkfs dd sudo"],
    ["git", "log", "--grep", "halt"], ["sh", "-c", "ls -la ~ /"],
]

DANGEROUS = [
    ("sudo ls", "sudo"), ("su -", "sudo"), ("doas id", "sudo"), ("pkexec id", "sudo"),
    ("shutdown -h now", "power"), ("reboot", "power"), ("halt", "power"), ("poweroff", "power"),
    ("systemctl reboot", "power"), ("init 0", "power"),
    ("rm -rf /", "rm-root"), ("rm -fr ~", "rm-root"), ("rm -r -f /*", "rm-root"), ('rm -rf "$HOME"', "rm-root"),
    ("rm --recursive --force --no-preserve-root /", "rm-root"), ("rm -rf ~/", "rm-root"), ("rm -Rf /usr", "rm-root"),
    ("mkfs.ext4 /dev/sdb1", "mkfs"), ("mkfs -t xfs /dev/vdb", "mkfs"), ("wipefs -a /dev/sda", "mkfs"),
    ("dd if=/dev/zero of=/dev/sda bs=1M", "block-device"), ("cat disk.img > /dev/nvme0n1", "block-device"),
    ("chmod -R 777 /", "chmod-root"), ("chown -R nobody ~", "chmod-root"),
]

# Every command position a shell has: the dangerous command must be refused in each.
POSITIONS = [
    "{}", "true; {}", "true && {}", "false || {}", "echo x | {}", "sleep 0 & {}", "echo $({})", "echo `{}`",
    'echo "$({})"', "if true; then {}; fi", "for i in 1; do {}; done", "while false; do :; done; {}",
    "true\n{}", "( {} )", "{{ {}; }}", "! {}", "FOO=1 {}", "env FOO=1 {}", "nohup {}", "timeout 5 {}",
    "exec {}", "command {}", "time {}", "nice -n 5 {}", "xargs -n 1 {}", "cat <({})", "eval '{}'",
    "sh -c '{}'", "bash -lc '{}'", "if false; then :; else {}; fi", "case x in x) {};; esac", "true |& {}",
    "true\\\n; {}",
]


@pytest.mark.parametrize("argv", MUST_PASS, ids=lambda argv: " ".join(argv)[:50])
def test_arguments_data_and_quoted_text_are_not_commands(argv):
    assert check(argv, BUILTIN) is None, list(commands(argv))


@pytest.mark.parametrize(("command", "rule"), DANGEROUS)
def test_dangerous_commands_are_refused_in_every_command_position(command, rule):
    argv = command.replace('"', "").split()  # as argv, no shell
    refused = check(argv, BUILTIN)
    assert refused is not None and refused.rule.name == rule
    for position in POSITIONS:
        for shell in ("sh", "bash", "/bin/dash"):
            script = position.format(command)
            refused = check([shell, "-c", script], BUILTIN)
            assert refused is not None, (shell, script, list(commands([shell, "-c", script])))
            assert refused.rule.name == rule, (script, str(refused))


def test_spelling_tricks_a_person_uses_are_seen_through():
    for argv in (["/usr/bin/sudo", "ls"], ["sh", "-c", "\\sudo ls"], ["sh", "-c", "s''udo ls"],
                 ["sh", "-c", '"sudo" ls'], ["busybox", "sh", "-c", "reboot"], ["bash", "-o", "pipefail", "-c", "sudo x"],
                 ["sh", "-c", "sh -c 'bash -c \"sudo x\"'"], ["sh", "-ec", "true\nsudo x"]):
        assert check(argv, BUILTIN) is not None, argv


# A wrapper's own command line (an option's value, or words it runs through a shell) is read
# like `sh -c`'s: env -S was the one typed form of a listed wrapper the guard missed (red team
# N14); the table's other options of that kind, optional values and option clusters with it.
WRAPPED = [
    ["env", "-S", "sudo -n true"], ["env", "-Ssudo -n true"], ["env", "-S'sudo' -n true"],
    ["env", "--split-string=sudo -n true"], ["env", "--split-string", "sudo -n true"], ["env", "--split", "sudo x"],
    ["env", "-iS", "sudo x"], ["env", "-vS'sudo x'"], ["env", "-S sudo -n true"], ["env", "-S", "sudo\\_-n\\_true"],
    ["env", "-S", "-i FOO=1 nice -n 5 sudo x"], ["env", "-S", "nice -n 5", "sudo", "x"], ["env", "-S", "-S 'sudo x'"],
    ["env", "-S", "sh -c 'true; sudo x'"], ["sh", "-c", "env -S 'sudo -n true'"], ["env", "-", "sudo", "x"],
    ["env", "-iu", "HOME", "sudo", "x"], ["env", "-uHOME", "sudo", "x"], ["env", "--unset=HOME", "sudo", "x"],
    ["flock", "/tmp/lock", "-c", "sudo x"], ["flock", "-w", "5", "/tmp/lock", "--command", "true; sudo x"],
    ["watch", "-n", "1", "true; sudo x"], ["watch", "sudo x"], ["watch", "-d", "sudo", "x"], ["watch", "-x", "sudo", "x"],
    ["xargs", "-i", "sudo", "x"], ["xargs", "-l", "sudo", "x"], ["xargs", "--replace", "sudo", "x"],
    ["stdbuf", "--output=L", "sudo", "x"], ["caffeinate", "-t", "10", "sudo", "x"], ["script", "-q", "-c", "sudo x", "log"],
    ["ionice", "-c", "3", "sudo", "x"], ["chrt", "-T", "10", "5", "sudo", "x"],
]


@pytest.mark.parametrize("argv", WRAPPED, ids=lambda argv: " ".join(argv)[:50])
def test_a_wrappers_own_command_line_is_read_like_sh_c(argv):
    refused = check(argv, BUILTIN)
    assert refused is not None and refused.rule.name == "sudo", list(commands(argv))


def test_a_wrappers_command_line_that_only_mentions_a_dangerous_word_passes():
    for argv in (["env", "-S", "echo sudo"], ["env", "-S", "grep 'sudo x'"], ["env", "-S", "#sudo"],
                 ["watch", "-n", "1", "ls", "-l"], ["script", "sudo.log"], ["flock", "/tmp/lock", "-c", "echo sudo"],
                 ["env", "-S", "python3 -c 'print(1)'", "sudo.txt"]):
        assert check(argv, BUILTIN) is None, (argv, list(commands(argv)))


def test_a_fork_bomb_is_refused_whatever_its_name():
    for script in (":(){ :|:& };:", "bomb() { bomb | bomb & }; bomb", "f(){ f|f & };f"):
        refused = check(["bash", "-c", script], BUILTIN)
        assert refused is not None and refused.rule.name == "fork-bomb"
    assert check(["bash", "-c", "f() { echo hi | cat; }; f"], BUILTIN) is None


def test_scripts_nested_too_deep_are_refused_not_skipped():
    import shlex

    script = "echo $(" * 20 + "true" + ")" * 20
    refused = check(["sh", "-c", script], BUILTIN)
    assert refused is not None and refused.rule.name == "nesting"
    assert check(["sh", "-c", "sh -c " + shlex.quote("sh -c " + shlex.quote("sudo x"))], BUILTIN).rule.name == "sudo"


def test_policy_rules_match_at_command_position_to_a_word_end():
    deny, warning = compile_rule("git push (--force|-f)")
    assert warning is None
    from egress.agent.commands import Rule

    rules = [Rule("deny", "git push (--force|-f)", "p.toml:3", deny)]
    assert check(["git", "push", "--force", "origin", "main"], rules) is not None
    assert check(["sh", "-c", "cd x && git push -f"], rules) is not None
    assert check(["git", "push", "--force-with-lease"], rules) is None  # a word's end, not a prefix
    assert check(["echo", "git push --force"], rules) is None
    assert str(check(["git", "push", "-f"], rules)) == \
        "command refused by deny_commands 'git push (--force|-f)' (p.toml:3): git push -f"


def test_an_invalid_regular_expression_is_matched_as_literal_text_with_a_warning():
    pattern, warning = compile_rule("npm (publish")
    assert warning is not None and "not a valid regular expression" in warning and "literal text" in warning
    assert pattern.match("npm (publish now") and not pattern.match("npm publish")


# ------------------------------------------------------------ output caps: the stream


def capped(data: bytes, limit: int, redact: bool = False, chunk: int = 4096) -> tuple[bytes, int]:
    detector = Detector()
    stream = CappedStream(limit, (lambda: StreamRedactor(detector)) if redact else None)
    out = [stream.feed(data[i:i + chunk]) for i in range(0, len(data), chunk)]
    out.append(stream.finish())
    return b"".join(out), stream.elided


def test_below_the_cap_a_stream_is_byte_exact_and_above_it_head_and_tail_are_exact():
    data = bytes(range(256)) * 40  # 10240 bytes, every byte value
    for limit in (len(data), len(data) + 1, 10 ** 6):
        for chunk in (1, 7, 4096, 10 ** 6):
            assert capped(data, limit, chunk=chunk) == (data, 0)
    text = b"".join(b"line %06d\n" % i for i in range(100_000))
    for chunk in (1, 7, 4096):
        out, elided = capped(text, 1000, chunk=chunk)
        head, tail = out.split(b"... [%d bytes elided by egress] ...\n" % elided)
        # the cut falls on line breaks near the 60%/40% marks: whole lines
        assert head == text[:600] and tail == text[-396:] and elided == len(text) - 996
    one_line = bytes(range(32, 127)) * 1000  # no line break anywhere: cut exactly at 60% and 40%
    out, elided = capped(one_line, 1000)
    head, tail = out.split(b"\n... [%d bytes elided by egress] ...\n" % elided)  # the marker starts a line
    assert head == one_line[:600] and tail == one_line[-400:] and elided == len(one_line) - 1000


def test_the_cut_never_splits_a_utf8_character():
    text = "é€😀".encode() * 5000
    out, elided = capped(text, 1001)
    body = out.replace(b"... [%d bytes elided by egress] ...\n" % elided, b"")
    body.decode("utf-8")  # raises if a character was split
    assert len(out) - len(b"... [%d bytes elided by egress] ...\n" % elided) - 1 + elided == len(text)


TOKEN = b"ghp_R8x2Kq9LmZ4vT7wN3pB6yH1cJ5dF0gS2aE8u"


def test_a_secret_cut_by_the_elision_is_never_printed_in_part():
    assert Detector().redact(b"x " + TOKEN) == b"x [redacted:github-token]"
    for offset in range(560, 640):  # the head's end (600) falls before, inside and after the token
        data = b"word " * (offset // 5) + b"token " + TOKEN + b"\n" + b"y" * 1500 + b"\nTOKEN=" + TOKEN[:30] + b"\n" \
            + b"export GITHUB=" + TOKEN + b" tail\n" + b"z" * 300
        for chunk in ((61, 4096) if offset % 8 else (1, 61, 4096)):
            out, _ = capped(data, 1000, redact=True, chunk=chunk)
            for size in range(8, len(TOKEN) + 1):
                for start in range(len(TOKEN) - size + 1):
                    assert TOKEN[start:start + size] not in out, (offset, chunk, out)


def test_a_token_with_escape_codes_inside_cut_by_the_elision_is_never_printed_in_part():
    # One long line (no line break to start the tail at): the tail's start may fall inside the
    # token, or inside an escape sequence inside it; no piece of the token is printed.
    token = b"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"
    tail = 1024 - int(1024 * 0.6)
    for noise in (b"\x1b[0m", b"\x1b[1;31;48;5;17m", b"\xe2\x80\x8b"):
        for back in range(tail - 60, tail + 30):
            data = b"x" * 5000 + b" " + token[:10] + noise + token[10:] + b" " + b"y" * (back - len(token) - 1)
            out, _ = capped(data, 1024, redact=True, chunk=100)
            assert not any(token[i:i + 8] in out for i in range(len(token) - 7)), (noise, back, out[:80])


def test_a_private_key_cut_by_the_elision_is_never_printed_in_part(tmp_path):
    openssl = subprocess.run(["openssl", "genrsa", "2048"], capture_output=True)
    if openssl.returncode != 0:
        pytest.skip("openssl (to make a real private key) is not available")
    key = openssl.stdout
    body = [line for line in key.splitlines()[1:-1] if len(line) >= 32]
    for before in range(0, 3000, 137):
        data = b"building...\n" * (before // 12) + key + b"done\n" * 60
        for limit in (1000, 2000, 4000):
            out, _ = capped(data, limit, redact=True, chunk=512)
            assert not [line for line in body if line[:16] in out or line[-16:] in out], (before, limit)


def test_memory_stays_bounded_whatever_is_fed():
    stream = CappedStream(4096)
    block = b"x" * 65536
    for _ in range(2000):  # 125 MiB
        stream.feed(block)
    assert len(stream._tail) <= 2 * stream.tail_size + 2 * 65536
    assert stream.finish().endswith(b"x" * (4096 - int(4096 * 0.6)))


@pytest.mark.parametrize(("text", "size"), [("0", 0), ("262144", 262144), ("256K", 262144), ("256KiB", 262144),
                                            ("1M", 1048576), ("2 mb", 2097152), ("1G", 1 << 30), (512, 512)])
def test_sizes_are_read_as_people_write_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-1", "1.5M", "1T", -1, True])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(ValueError):
        parse_size(text)


# ------------------------------------------------------------ real egress run


def egress(tmp_path: Path, *args: str, policy: str | None = None, entry: str = "egress.cli",
           stdout=subprocess.PIPE, env=None) -> subprocess.CompletedProcess:
    """``egress run --network off ARGS`` from a clean environment, in tmp_path/project."""
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (tmp_path / "launcher-tmp").mkdir(exist_ok=True)
    extra = []
    if policy is not None:
        (tmp_path / "policy.toml").write_text(policy)
        extra = ["--policy", str(tmp_path / "policy.toml")]
    command = [sys.executable, "-m", entry, "run", "--network", "off", "--state-dir", str(tmp_path / "state"),
               *extra, *args]
    return subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, timeout=300, cwd=project,
                          env=clean_env(tmp_path, PYTHONPATH=os.getcwd(), TMPDIR=str(tmp_path / "launcher-tmp"),
                                        **(env or {})))


@linux_only
@pytest.mark.parametrize("entry", ["egress.cli", "egress"])
def test_a_refused_command_exits_125_naming_the_rule_and_never_runs(tmp_path, entry):
    marker = tmp_path / "project" / "ran"
    result = egress(tmp_path, "--agent", "--", "sh", "-c", f"touch {marker}; sudo id", entry=entry)
    assert result.returncode == 125
    lines = result.stderr.decode().splitlines()
    assert lines == ["egress: command refused by the built-in rule 'sudo' (runs commands as another user): "
                     "sudo id; it was not run"]
    assert not marker.exists()


@linux_only
def test_env_split_string_is_refused_before_it_runs(tmp_path):
    # The red team's N14: `egress run --guard-commands -- env -S 'sudo -n true'` ran (status 127).
    result = egress(tmp_path, "--guard-commands", "--", "env", "-S", "sudo -n true")
    assert result.returncode == 125, result.stderr
    assert result.stderr.decode() == ("egress: command refused by the built-in rule 'sudo' (runs commands as "
                                      "another user): sudo -n true; it was not run\n")


@linux_only
def test_commands_that_only_mention_a_dangerous_word_run(tmp_path):
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "setup.md").write_text("never run sudo here\n")
    result = egress(tmp_path, "--agent", "--", "sh", "-c",
                    'grep -r "sudo" . ; echo "shutdown" >> notes.txt; cat notes.txt')
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode() == "./setup.md:never run sudo here\nshutdown\n"


@linux_only
def test_policy_rules_name_their_file_and_line_and_allow_wins(tmp_path):
    policy = ('allow = ["example.test"]\n'
              '[guardrails]\n'
              'deny_commands = [\n'
              '  "git push (--force|-f)",\n'
              '  "npm (publish",\n'
              ']\n'
              'allow_commands = ["sudo -n true"]\n')
    refused = egress(tmp_path, "--", "sh", "-c", "cd . && git push -f origin", policy=policy)
    path = tmp_path / "policy.toml"
    assert refused.returncode == 125
    stderr = refused.stderr.decode().splitlines()
    assert stderr[0] == (f"egress: {path}:5: warning: guardrails: deny_commands: 'npm (publish' is not a valid "
                         "regular expression (missing ), unterminated subpattern at position 4); it is matched "
                         "as literal text")
    assert stderr[1] == (f"egress: command refused by deny_commands 'git push (--force|-f)' ({path}:4): "
                         "git push -f origin; it was not run")
    literal = egress(tmp_path, "--", "npm", "(publish", policy=policy)
    assert literal.returncode == 125 and f"deny_commands 'npm (publish' ({path}:5)" in literal.stderr.decode()
    # the policy's deny rules turn the built-in ones on; its allow rule wins over them
    assert egress(tmp_path, "--", "sudo", "id", policy=policy).returncode == 125
    allowed = egress(tmp_path, "--", "sh", "-c", "sudo -n true; echo ran", policy=policy)
    assert allowed.returncode == 0 and b"ran" in allowed.stdout  # sudo itself is absent or refuses inside


@linux_only
def test_a_guardrails_table_that_is_wrong_is_a_policy_problem(tmp_path):
    result = egress(tmp_path, "--", "true", policy='profile = "yolo"\n[guardrails]\ndeny_command = ["x"]\n'
                    '[limits]\nmax_output = "lots"\n')
    assert result.returncode == 125
    stderr = result.stderr.decode()
    assert "unknown key 'deny_command'; did you mean 'deny_commands'?" in stderr
    assert "max_output: 'lots' is not a size" in stderr and "profile: 'yolo' is not a profile" in stderr


PRINT = "import sys; out = sys.stdout.buffer; [out.write(b'line %08d\\n' % i) for i in range({})]"


@linux_only
@pytest.mark.parametrize("entry", ["egress.cli", "egress"])
def test_a_large_output_keeps_its_head_and_tail_and_says_what_was_elided(tmp_path, entry):
    lines = 200_000  # 3.2 MB on each stream
    script = PRINT.format(lines) + "; [sys.stderr.write('err %08d\\n' % i) for i in range(100000)]"
    result = egress(tmp_path, "--max-output", "64K", "--", sys.executable, "-c", script, entry=entry)
    assert result.returncode == 0
    whole = b"".join(b"line %08d\n" % i for i in range(lines))
    head, rest = result.stdout.split(b"... [", 1)
    count, tail = rest.split(b" bytes elided by egress] ...\n")
    # whole lines, the cut on the line breaks nearest the 60% and 40% marks
    assert head == whole[:len(head)] and int(65536 * 0.6) - 14 < len(head) <= int(65536 * 0.6)
    assert tail == whole[-len(tail):] and tail.startswith(b"line ") and 26214 - 14 < len(tail) <= 26214
    assert int(count) == len(whole) - len(head) - len(tail)
    errors = result.stderr.decode()
    assert errors.startswith("err 00000000\n") and errors.endswith("err 00099999\n")
    assert "bytes elided by egress] ...\n" in errors and len(errors.encode()) < 65536 + 100


@linux_only
def test_an_output_at_the_cap_is_byte_exact(tmp_path):
    for size in (65536, 65535):
        result = egress(tmp_path, "--max-output", "64K", "--", "head", "-c", str(size), "/dev/urandom")
        assert result.returncode == 0 and len(result.stdout) == size and b"elided" not in result.stdout


@linux_only
def test_a_policy_sets_the_cap_and_the_flag_overrides_it(tmp_path):
    policy = "[limits]\nmax_output = \"1K\"\n"
    capped_run = egress(tmp_path, "--", "seq", "100000", policy=policy)
    assert b"elided by egress" in capped_run.stdout and len(capped_run.stdout) < 1100
    whole = egress(tmp_path, "--max-output", "0", "--", "seq", "100000", policy=policy)
    assert whole.stdout == b"".join(b"%d\n" % i for i in range(1, 100001))


@linux_only
def test_a_huge_output_goes_through_the_cap_in_bounded_memory(tmp_path):
    """512 MiB printed through a 256 KiB cap: egress's peak memory stays far below what passed."""
    (tmp_path / "project").mkdir()
    (tmp_path / "launcher-tmp").mkdir()
    probe = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE); "
             "print(len(p.stdout), p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    command = [sys.executable, "-c", probe, sys.executable, "-m", "egress", "run", "--network", "off",
               "--state-dir", str(tmp_path / "state"), "--max-output", "256K", "--redact", "--",
               "sh", "-c", "head -c 536870912 /dev/zero | tr '\\0' 'a' | fold -w 100"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path / "project",
                            env=clean_env(tmp_path, PYTHONPATH=os.getcwd(), TMPDIR=str(tmp_path / "launcher-tmp")))
    printed, status, peak_kib = map(int, result.stdout.split())
    assert status == 0 and printed < 256 * 1024 + 100
    assert peak_kib < 160 * 1024, f"egress run peaked at {peak_kib} KiB for 512 MiB through a 256 KiB cap"


@linux_only
def test_redaction_comes_after_the_cap_and_a_cut_secret_is_not_printed(tmp_path):
    secret = "ghp_R8x2Kq9LmZ4vT7wN3pB6yH1cJ5dF0gS2aE8u"
    # the head's end (614 of 1024) falls in the middle of the token
    script = f"printf '%0600d tok {secret}\\n' 0; seq 100000; echo 'last {secret}'"
    result = egress(tmp_path, "--redact", "--max-output", "1K", "--", "sh", "-c", script)
    out = result.stdout.decode()
    assert result.returncode == 0 and "bytes elided by egress" in out
    assert out.endswith("last [redacted:github-token]\n")
    assert not any(secret[i:i + 8] in out for i in range(len(secret) - 7)), out


@linux_only
@pytest.mark.parametrize("how", ["flag", "policy"])
def test_agent_turns_on_every_guardrail_and_each_can_still_be_set(tmp_path, how):
    secret = "ghp_R8x2Kq9LmZ4vT7wN3pB6yH1cJ5dF0gS2aE8u"
    policy, flag = ('profile = "agent"\n', []) if how == "policy" else (None, ["--agent"])
    big = egress(tmp_path, *flag, "--", "sh", "-c", f"echo {secret}; seq 200000", policy=policy)
    out = big.stdout.decode()
    assert big.returncode == 0 and out.startswith("[redacted:github-token]\n1\n")  # redacted
    assert "bytes elided by egress" in out and len(big.stdout) <= 256 * 1024 + 100  # 256 KiB cap
    assert egress(tmp_path, *flag, "--", "reboot", policy=policy).returncode == 125  # the deny list
    uncapped = egress(tmp_path, *flag, "--max-output", "0", "--", "seq", "200000", policy=policy)
    assert b"elided" not in uncapped.stdout and uncapped.stdout.endswith(b"\n200000\n")
    timed = egress(tmp_path, *flag, "--timeout", "0.5", "--", "sleep", "30", policy=policy)
    assert timed.returncode == 124

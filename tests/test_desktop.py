"""Real desktops: the API schemas, office files, tasks, the Apptainer commands, and — where the Debian packages
are installed (``bash launch/bootstrap.sh test`` installs them as root) — the xvfb backend itself: every task's
solver passes and doing nothing fails, the sandbox confines writes and has no network, and a crashed X server
is detected and its desktop rebuilt while the env_server keeps serving."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from common.net import free_port
from common.rundir import RunDir
from env_server.actions import ActionError
from env_server.backend import BackendError
from env_server.client import EnvClient, EnvError
from env_server.config import EnvServerConfig
from env_server.desktop import apis
from env_server.desktop import docfiles
from env_server.desktop import families as desk_tasks
from env_server.desktop.sandbox import (AGENT_DIR, ApptainerSandbox, BwrapSandbox, SandboxSpec, desktop_packages,
                                        missing_packages, require_packages)
from env_server.server import EnvServer
from tests.conftest import REPO, make_net, needs_desktop


# ----- no packages needed -------------------------------------------------------------------------------------


def test_the_verifiers_copy_leaves_out_links_devices_fifos_and_oversized_files(tmp_path):
    from env_server.desktop import homefs

    secret = tmp_path / "host-secret.txt"
    secret.write_text("the cat sat on the mat\n")
    home = tmp_path / "home"
    (home / "Documents").mkdir(parents=True)
    (home / "Documents" / "plain.txt").write_text("hello\n")
    (home / "Documents" / "notes1.txt").symlink_to(secret)  # would pass editor_new_file's verifier
    (home / "zero").symlink_to("/dev/zero")  # would run a reader out of memory
    (home / "Desktop").symlink_to(tmp_path)  # a folder link out of the home
    os.mkfifo(home / "pipe")  # would block an open
    (home / "big.bin").write_bytes(bytes(2048))
    copy = tmp_path / "copy"
    copy.mkdir()
    report = homefs.snapshot(home, copy, homefs.SnapshotLimits(max_file_bytes=1024))
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*")) == ["Documents", "Documents/plain.txt"]
    assert report.skipped == {"link": 3, "special_file": 1, "too_large": 1}
    task = desk_tasks.Task("desk:train:editor_new_file/0", "editor_new_file", "train", 0, "",
                  {"name": "notes1.txt", "text": "the cat sat on the mat"}, True, 5)
    verify = desk_tasks.FAMILIES[task.family].verify
    assert verify(task.params, home), "the raw home would have fooled the verifier"
    assert not verify(task.params, copy)


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops to nobody only when started as root")
def test_roots_sandbox_binds_agent_files_nobody_can_read(tmp_path):
    """A checkout under a mode-700 folder (root's home, mktemp -d) is closed to nobody: the sandbox binds a
    readable copy of the agent's modules instead."""
    from env_server.desktop.sandbox import AGENT_DIR, SANDBOX_AGENT_DIR, readable_agent_dir

    spec = SandboxSpec(tmp_path, 640, 480, False, 10.0, 10.0)
    argv = BwrapSandbox(spec).argv()
    bound = argv[argv.index(SANDBOX_AGENT_DIR) - 1]
    assert Path(bound) == readable_agent_dir() and Path(bound) != AGENT_DIR
    for folder in [Path(bound), *Path(bound).parents]:
        assert folder.stat().st_mode & 0o005 == 0o005, folder  # others may list and enter it
    assert sorted(p.name for p in Path(bound).glob("*.py")) == sorted(p.name for p in AGENT_DIR.glob("*.py"))
    assert all(p.stat().st_mode & 0o004 for p in Path(bound).glob("*.py"))


def test_a_reset_never_writes_through_a_planted_link_and_hands_the_home_back(tmp_path):
    from env_server.desktop import homefs

    host_dir = tmp_path / "host"
    host_dir.mkdir()
    (host_dir / "keep.txt").write_text("host file\n")
    home = tmp_path / "home"
    home.mkdir()
    (home / "Documents").symlink_to(host_dir)  # planted: the next task writes Documents/...
    (home / "old").mkdir()
    (home / "old" / "link").symlink_to(host_dir / "keep.txt")
    staged = tmp_path / "staged"
    (staged / "Documents").mkdir(parents=True)
    (staged / "Documents" / "keep.txt").write_text("task file\n")
    (staged / "top.txt").write_text("x\n")
    owner = 65534 if os.geteuid() == 0 else None
    homefs.refill(home, staged, owner)
    assert (host_dir / "keep.txt").read_text() == "host file\n" and sorted(os.listdir(host_dir)) == ["keep.txt"]
    assert not (home / "Documents").is_symlink() and (home / "Documents" / "keep.txt").read_text() == "task file\n"
    assert sorted(os.listdir(home)) == ["Documents", "top.txt"]
    if owner is not None:
        assert {p.lstat().st_uid for p in [home, *home.rglob("*")]} == {owner}
    # The home itself a link: refused, nothing written anywhere.
    (tmp_path / "home2").symlink_to(host_dir)
    with pytest.raises(homefs.HomeError):
        homefs.refill(tmp_path / "home2", staged, owner)
    assert sorted(os.listdir(host_dir)) == ["keep.txt"]


def test_api_calls_bind_by_position_and_keyword_and_reject_what_does_not_fit():
    assert apis.bind("Calc", "set_cell_value", ("B2",), {"value": 3}) == {"cell": "B2", "value": 3}
    assert apis.bind("Calc", "sort_range", ("A1:B4", "B"), {"ascending": False}) == \
        {"range": "A1:B4", "column": "B", "ascending": False}
    for args, kwargs, msg in [((), {}, "needs cell"), (("B2", 1, 2), {}, "at most"), (("B2",), {"colour": 1}, "no parameter"),
                              ((5, 1), {}, "cell must be string"), (("B2", True), {}, "value must be")]:
        with pytest.raises(apis.ApiArgumentError, match=msg):
            apis.bind("Calc", "set_cell_value", args, kwargs)
    with pytest.raises(apis.ApiArgumentError, match="has no function"):
        apis.bind("Writer", "explode", (), {})
    with pytest.raises(apis.ApiArgumentError, match="no app API"):
        apis.bind("Chrome", "open", (), {})
    assert {"Calc", "Writer", "Files"} <= set(apis.APPS)


def test_office_files_written_for_setup_read_back_by_the_verifier_readers(tmp_path):
    docfiles.write_ods(tmp_path / "t.ods", [["name", "amount"], ["kim", 3], ["a & b", 2.5]])
    assert docfiles.sheet_cells(tmp_path / "t.ods") == {"A1": "name", "B1": "amount", "A2": "kim", "B2": 3.0,
                                                 "A3": "a & b", "B3": 2.5}
    docfiles.write_odt(tmp_path / "t.odt", ["First <line>.", "Second."])
    assert docfiles.doc_paragraphs(tmp_path / "t.odt") == ["First <line>.", "Second."]
    (tmp_path / "bad.ods").write_text("not a zip")
    with pytest.raises(docfiles.DocError):
        docfiles.sheet_cells(tmp_path / "bad.ods")
    assert docfiles.col_name(0) == "A" and docfiles.col_name(25) == "Z" and docfiles.col_name(26) == "AA"
    assert docfiles.same_number("1,234", 1234) and not docfiles.same_number("x", 1)


def test_odt_fonts_resolve_span_over_paragraph_over_parents_over_defaults(tmp_path):
    import zipfile
    ns = ('xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0" '
          'xmlns:style="urn:oasis:names:tc:opendocument:xmlns:style:1.0" '
          'xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0" '
          'xmlns:fo="urn:oasis:names:tc:opendocument:xmlns:xsl-fo-compatible:1.0"')
    styles = (f'<office:document-styles {ns}><office:styles>'
              '<style:default-style style:family="paragraph"><style:text-properties style:font-name="Sans" '
              'fo:font-size="12pt"/></style:default-style>'
              '<style:style style:name="Body" style:family="paragraph"><style:text-properties '
              'style:font-name="Serif"/></style:style></office:styles></office:document-styles>')
    content = (f'<office:document-content {ns}><office:automatic-styles>'
               '<style:style style:name="P1" style:family="paragraph" style:parent-style-name="Body">'
               '<style:text-properties fo:font-size="14pt"/></style:style>'
               '<style:style style:name="T1" style:family="text"><style:text-properties fo:font-weight="bold"/>'
               '</style:style></office:automatic-styles><office:body><office:text>'
               '<text:p text:style-name="P1">plain <text:span text:style-name="T1">bold</text:span> tail</text:p>'
               '<text:p>unstyled</text:p></office:text></office:body></office:document-content>')
    with zipfile.ZipFile(tmp_path / "f.odt", "w") as z:
        z.writestr("mimetype", "application/vnd.oasis.opendocument.text")
        z.writestr("content.xml", content)
        z.writestr("styles.xml", styles)
    assert docfiles.odt_text_fonts(tmp_path / "f.odt") == [
        ("plain ", "Serif", 14.0), ("bold", "Serif", 14.0), (" tail", "Serif", 14.0), ("unstyled", "Sans", 12.0)]


def test_the_real_suite_has_twenty_task_families_across_apps_with_deterministic_instances():
    assert len(desk_tasks.FAMILIES) >= 20
    multi = [f for f in desk_tasks.FAMILIES.values() if len(f.apps) > 1]
    assert len(multi) >= 3
    assert {"Calc", "Writer", "Editor", "Files"} <= {a for f in desk_tasks.FAMILIES.values() for a in f.apps}
    a, b = desk_tasks.make_task("desk:train/7"), desk_tasks.make_task("desk:train/7")
    assert a.instruction == b.instruction and a.params == b.params
    assert desk_tasks.make_task("desk:train:calc_sort,files_move/1").family == "files_move"
    for bad in ("desk", "desk:train/x", "sim:train/1", "desk:train:nope/1", "desk:calc_sum/1"):
        with pytest.raises(ActionError):
            desk_tasks.make_task(bad)


def test_real_desktop_tasks_have_held_out_instances_and_a_held_out_phrasing():
    for fam in desk_tasks.FAMILY_NAMES:
        train = [desk_tasks.make_task(f"desk:train:{fam}/{s}") for s in range(6)]
        held = [desk_tasks.make_task(f"desk:heldout:{fam}/{s}") for s in range(6)]
        para = [desk_tasks.make_task(f"desk:paraphrase:{fam}/{s}") for s in range(6)]
        assert {t.template for t in train + held} == {0} and {t.template for t in para} == {1}, fam
        assert [t.params for t in para] == [t.params for t in held], "the paraphrase split rewords held-out instances"
        assert all(p.instruction != h.instruction for p, h in zip(para, held)), fam
        # a disjoint generator stream (a small instance space may still repeat an instance by chance)
        assert [t.params for t in train] != [t.params for t in held], fam


def test_a_missing_file_fails_the_verifier_instead_of_raising(tmp_path):
    task = desk_tasks.make_task("desk:train:calc_sum/0")
    assert desk_tasks.FAMILIES[task.family].verify(task.params, tmp_path) is False


def test_missing_packages_are_named_in_one_clear_error(tmp_path):
    listing = tmp_path / "packages.txt"
    listing.write_text("# comment\nxvfb   cmd:sh\nfakepkg   cmd:definitely-not-a-command-here\n"
                       "otherpkg  file:/no/such/file\nthirdpkg py:no_such_module_xyz\n")
    pkgs = desktop_packages(listing)
    assert missing_packages(pkgs) == ["fakepkg", "otherpkg", "thirdpkg"]
    with pytest.raises(BackendError, match="fakepkg otherpkg thirdpkg.*apt-get install"):
        require_packages("xvfb", pkgs)


def test_the_apptainer_image_installs_exactly_what_the_xvfb_backend_needs():
    text = (REPO / "configs" / "desktop.def").read_text()
    line = re.search(r"apt-get install -y --no-install-recommends (.+)", text).group(1)
    assert line.split() == [pkg for _, pkg in desktop_packages()]
    assert "Bootstrap: docker" in text and "From: debian:bookworm" in text


def test_apptainer_commands_isolate_the_desktop_and_fail_clearly(tmp_path):
    spec = SandboxSpec(tmp_path, 1280, 720, office=True, start_timeout_s=30, office_call_timeout_s=60)
    box = ApptainerSandbox(spec, str(tmp_path / "desktop.sif"), apptainer="apptainer")
    assert box.name.startswith(f"computerrl-desktop-{os.getpid()}-")
    # The exact commands: Apptainer refuses HOME through --env (so --home SRC:DEST), and variables given to
    # `instance start` never reach what `exec instance://` runs (so --cleanenv and --env go on exec).
    assert box.start_argv() == [
        "apptainer", "instance", "start", "--containall", "--cleanenv", "--writable-tmpfs", "--net", "--network",
        "none", "--home", f"{tmp_path / 'home'}:/home/user", "--bind", f"{tmp_path / 'run'}:/run/computerrl",
        "--bind", f"{AGENT_DIR}:/opt/computerrl-desktop:ro", str(tmp_path / "desktop.sif"), box.name]
    env = ["--env", "USER=user", "--env", "LOGNAME=user", "--env", "LANG=C.UTF-8", "--env",
           "PATH=/usr/local/bin:/usr/bin:/bin", "--env", "XDG_RUNTIME_DIR=/tmp/runtime-user", "--env", "GDK_BACKEND=x11"]
    assert box.exec_argv() == ["apptainer", "exec", "--cleanenv", "--pwd", "/home/user", *env,
                               f"instance://{box.name}", *spec.agent_argv()]
    assert "dbus-run-session" in box.exec_argv() and "--office" in box.exec_argv()
    assert box.stop_argv() == ["apptainer", "instance", "stop", "--force", box.name]
    with pytest.raises(BackendError, match="needs the '/nonexistent/apptainer' command"):
        ApptainerSandbox(spec, "x.sif", apptainer="/nonexistent/apptainer").start()
    with pytest.raises(BackendError, match="no desktop image .*apptainer build"):
        ApptainerSandbox(spec, str(tmp_path / "missing.sif"), apptainer=shutil.which("true")).start()
    assert not box.alive()
    box.stop()  # never started: nothing to stop, no error


def test_a_retired_desktops_folder_is_removed_past_late_writes_and_a_sandbox_ending_by_itself_is_not_killed(tmp_path, monkeypatch):
    """An agent asked to shut down closes its apps, which write into the home as they exit: the sandbox gets a grace
    to end by itself, and the folder's removal outlasts writes that land while it is walked (the CI failure at
    08b0ad4: a closed desktop's folder stayed). A folder that will not go is a BackendError naming what is left."""
    import env_server.desktop.backend as desktop_backend
    from env_server.desktop.backend import remove_folder
    from env_server.desktop.sandbox import _stop_group

    # The first walk is overtaken by a write (an app saving its settings as it exits): the folder is still there
    # after it, and only a second walk removes it.
    folder = tmp_path / "desktop-late"
    (folder / "home").mkdir(parents=True)
    walks, rmtree = [], shutil.rmtree

    def overtaken(path, ignore_errors=False):
        walks.append(path)
        rmtree(path, ignore_errors=ignore_errors)
        if len(walks) == 1:
            path.mkdir()
            (path / "saved-late").write_text("settings")
    monkeypatch.setattr(desktop_backend.shutil, "rmtree", overtaken)
    remove_folder(folder, within_s=3.0)
    assert not folder.exists() and len(walks) == 2
    monkeypatch.undo()

    # A folder that cannot go (a busy mount, here an rmtree that removes nothing) is said, with its contents.
    stuck = tmp_path / "desktop-stuck"
    (stuck / "run").mkdir(parents=True)
    (stuck / "run" / "agent.sock").touch()
    monkeypatch.setattr(desktop_backend.shutil, "rmtree", lambda path, ignore_errors=False: None)
    with pytest.raises(BackendError, match=r"could not be removed; left in it: \['run', 'run/agent.sock'\]"):
        remove_folder(stuck, within_s=0.3)
    monkeypatch.undo()

    ends = subprocess.Popen(["sleep", "0.3"], start_new_session=True)
    _stop_group(ends, grace_s=5.0)
    assert ends.returncode == 0  # it ended by itself; no signal
    hangs = subprocess.Popen(["sleep", "30"], start_new_session=True)
    t0 = time.monotonic()
    _stop_group(hangs, grace_s=0.2)
    assert hangs.returncode == -15 and time.monotonic() - t0 < 3


def test_instances_a_crashed_env_server_left_running_are_stopped(tmp_path):
    """Instances outlive a killed env_server; the next one's first desktop stops those whose owner is gone."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    listing = {"instances": [{"instance": f"computerrl-desktop-{dead.pid}-aaaa", "pid": 11, "img": "d.sif"},
                             {"instance": f"computerrl-desktop-{os.getpid()}-bbbb", "pid": 12, "img": "d.sif"},
                             {"instance": "someone-elses-db", "pid": 13, "img": "db.sif"}]}
    assert ApptainerSandbox.orphans(json.dumps(listing)) == [f"computerrl-desktop-{dead.pid}-aaaa"]
    assert ApptainerSandbox.orphans('{"instances": []}') == []
    log = tmp_path / "calls"
    fake = tmp_path / "apptainer"
    fake.write_text(f"""#!/bin/sh
echo "$@" >> {log}
if [ "$2" = list ]; then echo '{json.dumps(listing)}'; fi
""")
    fake.chmod(0o755)
    spec = SandboxSpec(tmp_path, 1280, 720, office=False, start_timeout_s=30, office_call_timeout_s=60)
    assert ApptainerSandbox(spec, "d.sif", apptainer=str(fake)).stop_orphans() == 1
    assert log.read_text().splitlines() == ["instance list --json",
                                            f"instance stop --force computerrl-desktop-{dead.pid}-aaaa"]


def test_env_server_config_takes_the_real_backends():
    EnvServerConfig(backend="xvfb").validate()
    EnvServerConfig(backend="apptainer").validate()
    with pytest.raises(ValueError, match=r"neither built in \(sim, xvfb, apptainer\)"):
        EnvServerConfig(backend="vnc").validate()


# ----- real desktops --------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_desktop
def test_every_task_is_solved_by_its_solver_and_failed_by_doing_nothing(desktop):
    backend = desktop(screenshot="jpeg")
    results = {}
    for i, fam in enumerate(desk_tasks.FAMILIES):
        task_id = f"desk:train:{fam}/{i}"
        obs = backend.reset(task_id)
        assert obs["instruction"] and obs["windows"], fam
        errors = []
        for action in backend.scripted_actions():
            r = backend.step(action)
            if r.action_error or r.format_error:
                errors.append((action, r.obs["last_result"]))
            if r.done:
                break
        solved = backend.evaluate()["success"]
        backend.reset(task_id)
        backend.step("done()")
        idle = backend.evaluate()["success"]
        results[fam] = (solved, idle, errors)
    failed = {f: r for f, r in results.items() if not r[0] or r[1]}
    assert not failed, failed
    shot = backend.observation()["screenshot"]
    assert shot[:2] == b"\xff\xd8"  # a JPEG


@pytest.mark.slow
@needs_desktop
def test_gui_actions_drive_the_editor_and_bad_actions_are_observations(desktop, tmp_path):
    template = tmp_path / "template"
    (template / ".config").mkdir(parents=True)
    (template / ".config" / "marker").write_text("from the template")
    backend = desktop(office=False, screenshot="none", home_template=str(template))
    (backend.spec.home / "left-over.txt").write_text("from an earlier episode")
    obs = backend.reset("desk:train:editor_append/0")
    assert (backend.spec.home / ".config" / "marker").read_text() == "from the template"
    assert not (backend.spec.home / "left-over.txt").exists()  # a fresh home each reset
    assert obs["focused_app"] == "Editor"
    text_rows = [r for r in obs["tree"] if r[1] == "text" and "editable" in r[4]]
    assert text_rows and text_rows[0][5].startswith("buy ")
    r = backend.step(f"click({text_rows[0][0]})")
    assert not r.action_error, r.obs["last_result"]
    for bad, kind in [("click(9999)", "action"), ("click('No Such Button')", "action"), ("Calc.frobnicate()", "action"),
                      ("click(x=5000, y=5)", "action"), ("import os", "format"), ("open_app('Chrome')", "action")]:
        r = backend.step(bad)
        assert (r.action_error if kind == "action" else r.format_error), bad
        assert r.obs["last_result"].startswith("ERROR")
    r = backend.step("type('Ünïcode ✓ line', enter=True)")
    r = backend.step("hotkey('ctrl+s')")
    time.sleep(0.5)
    assert "Ünïcode ✓ line" in (backend.spec.home / "todo.txt").read_text()


@pytest.mark.slow
@needs_desktop
def test_the_sandbox_confines_writes_to_its_home_and_has_no_network(desktop, tmp_path):
    backend = desktop(office=False, screenshot="none")
    backend.reset("desk:train:files_create_folder/0")
    outside = tmp_path / "outside.txt"
    for path in ("/etc/computerrl-escape", str(outside), "/usr/escape.txt"):
        r = backend.step(f"Files.write_text({path!r}, 'escaped')")
        assert r.action_error, (path, r.obs["last_result"])
        assert not Path(path).exists()
    r = backend.step("Files.write_text('/home/user/inside.txt', 'fine')")
    assert not r.action_error and (backend.spec.home / "inside.txt").read_text() == "fine"
    r = backend.step("Files.read_text('/etc/shadow')")
    assert r.action_error  # the host's secrets are not readable inside

    # The same sandbox command line, running a probe instead of the agent: no route out, not even to this host.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    probe = ("import socket\nfor host in ('127.0.0.1', '1.1.1.1', '8.8.8.8'):\n"
             "    s = socket.socket(); s.settimeout(2)\n"
             "    try:\n        s.connect((host, %d if host == '127.0.0.1' else 53)); print('CONNECTED', host)\n"
             "    except OSError as e:\n        print('blocked', host, e.errno)\n"
             "import os; print('HOST_REPO_VISIBLE', os.path.exists(%r))\n") % (port, str(REPO))
    box = BwrapSandbox(backend.spec)
    out = subprocess.run(box.argv(["python3", "-c", probe]), capture_output=True, text=True, timeout=30)
    listener.close()
    assert "CONNECTED" not in out.stdout, out.stdout
    assert out.stdout.count("blocked") == 3, out.stdout + out.stderr
    assert "HOST_REPO_VISIBLE False" in out.stdout


@pytest.mark.slow
@needs_desktop
def test_links_planted_in_a_real_desktops_home_are_refused_by_verifier_and_reset(desktop):
    backend = desktop()
    backend.reset("desk:train:editor_new_file/0")
    with pytest.raises(ActionError, match="fault injection is off"):  # no test hook in a normal desktop
        backend._call("debug_kill", target="xvfb")
    p = backend.task.params
    host = Path(tempfile.mkdtemp(prefix="computerrl-host-"))
    try:
        (host / "answer.txt").write_text(p["text"] + "\n")
        target = backend.spec.home / "Documents" / p["name"]
        target.symlink_to(host / "answer.txt")  # the right content, but a host file
        result = backend.evaluate()
        assert result["success"] is False and result["home_skipped"] == {"link": 1}
        target.unlink()
        target.symlink_to("/dev/zero")
        t0 = time.monotonic()
        assert backend.evaluate()["success"] is False and time.monotonic() - t0 < 30
        # A folder link where the next task writes its files: the reset replaces it, writing nothing through it.
        shutil.rmtree(backend.spec.home / "Documents")
        (backend.spec.home / "Documents").symlink_to(host)
        backend.reset("desk:train:editor_new_file/1")
        assert os.listdir(host) == ["answer.txt"]
        assert (backend.spec.home / "Documents").is_dir() and not (backend.spec.home / "Documents").is_symlink()
    finally:
        shutil.rmtree(host, ignore_errors=True)


@pytest.mark.slow
@needs_desktop
def test_a_sandbox_that_cannot_start_says_why(desktop, work_dir):
    broken = work_dir / "bwrap"  # what a host without user namespaces looks like
    broken.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    broken.chmod(0o755)
    backend = desktop()
    backend.sandbox.bwrap = str(broken)
    with pytest.raises(BackendError, match="(?s)exited before its agent was ready.*No permissions to creating"):
        backend.reset("desk:train:editor_new_file/0")


@pytest.mark.slow
@needs_desktop
def test_a_crashed_x_server_is_detected_the_desktop_rebuilt_and_other_sessions_keep_working(tmp_path, work_dir,
                                                                                            quiet_log):
    net = make_net()
    cfg = EnvServerConfig(port=free_port(), backend="xvfb", pool_size=2, metrics_interval_s=0.2,
                          health_interval_s=0.5)
    cfg.desktop.office = False
    cfg.desktop.screenshot = "none"
    cfg.desktop.work_dir = str(work_dir)
    cfg.desktop.fault_injection = True
    server = EnvServer(cfg, net, RunDir.create(tmp_path / "run"), quiet_log)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    client = EnvClient(net, "127.0.0.1", cfg.port, None, quiet_log)
    client.connect(10)
    try:
        victim, bystander = client.open(), client.open()
        client.reset(victim, "desk:train:editor_append/0")
        client.reset(bystander, "desk:train:editor_replace/1")
        backend = server.sessions[victim].backend
        backend.agent.call("debug_kill", target="xvfb")
        assert not backend.healthy()
        with pytest.raises(EnvError, match="backend_error"):
            client.step(victim, "type('x')")
        r = client.step(bystander, "hotkey('ctrl+End')")  # the other desktop is untouched
        assert "ERROR" not in r.obs["last_result"]
        obs = client.reset(victim, "desk:train:editor_append/2")  # a fresh desktop for the next episode
        assert obs["focused_app"] == "Editor"
        assert server.counters["desktops_retired_error"] >= 1
        assert server.counters["desktops_started"] == 3
    finally:
        client.close()
        server.request_stop()
        thread.join(30)
    assert not thread.is_alive()
    # Retired desktops close on worker threads: the agent's shutdown call (up to 5 s), the sandbox's SIGTERM (3 s)
    # and SIGKILL, then the folder's removal. 10 s was once too short for that on a loaded machine (a whole-suite run).
    deadline = time.monotonic() + 30
    while list(work_dir.glob("desktop-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(work_dir.glob("desktop-*"))


@pytest.mark.slow
@needs_desktop
def test_eval_plays_a_policy_on_a_real_desktop_suite(work_dir):
    import dataclasses

    from env_server.desktop.backend import DesktopConfig
    from launch.config import config_for_checkpoint
    from launch.evaluate import evaluate, load_policy, suite_tasks

    tasks = suite_tasks("desk:heldout:files_create_folder,editor_append", 1)
    assert tasks == ["desk:heldout:files_create_folder/0", "desk:heldout:editor_append/0"]
    base = REPO / "configs" / "base-policy"
    engine, prompt_cfg, sampling, _ = load_policy(base, config_for_checkpoint(base))
    result = evaluate(engine, tasks, prompt_cfg, dataclasses.replace(sampling, temperature=0.0), max_steps=2,
                      env=EnvServerConfig(backend="xvfb", desktop=DesktopConfig(office=False, screenshot="none",
                                                                                 work_dir=str(work_dir))))
    assert result["episodes"] == 2 and set(result["per_family"]) == {"files_create_folder", "editor_append"}
    assert 0.0 <= result["success_rate"] <= 1.0 and result["mean_steps"] <= 2
    assert not list(work_dir.glob("desktop-*"))  # the desktops were closed


@pytest.mark.slow
@needs_desktop
def test_a_run_and_an_eval_on_real_desktops(tmp_path, work_dir):
    """The real-desktop recipe (configs/desk.yaml: Calc, the editor, the file manager) through `computerrl run`
    and `computerrl eval`, briefly; the desktops are closed afterwards."""
    pytest.importorskip("torch")
    from tests.test_local_run import recipe_run

    result = recipe_run("configs/desk.yaml", tmp_path / "run", "env_server.pool_size=4",
                        f"env_server.desktop.work_dir={work_dir}")
    assert 0.0 <= result["success_rate"] <= 1.0
    assert not list(work_dir.glob("desktop-*"))

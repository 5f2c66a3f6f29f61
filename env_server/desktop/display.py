"""The desktop's X server, window manager, XTEST input, window list and screenshots.

Part of the in-desktop agent (``agent.py``): runs inside the sandbox on the system python3, imported by name
from the agent's folder."""

from __future__ import annotations

import io
import os
import subprocess
import time
from collections import OrderedDict

from agent_base import ActionFailure

KEY_NAMES = {"ctrl": "Control_L", "control": "Control_L", "shift": "Shift_L", "alt": "Alt_L", "super": "Super_L",
             "win": "Super_L", "meta": "Super_L", "enter": "Return", "return": "Return", "esc": "Escape",
             "escape": "Escape", "tab": "Tab", "backspace": "BackSpace", "delete": "Delete", "del": "Delete",
             "space": "space", "up": "Up", "down": "Down", "left": "Left", "right": "Right", "home": "Home",
             "end": "End", "pageup": "Prior", "pagedown": "Next", "insert": "Insert", "menu": "Menu"}
CHAR_NAMES = {"\n": "Return", "\t": "Tab", " ": "space"}


class Display:
    """The X display: Xvfb and the window manager as children, Xlib for input, windows and pixels."""

    def __init__(self, width: int, height: int, wm: str):
        self.width, self.height = width, height
        read_fd, write_fd = os.pipe()
        # -displayfd: Xvfb picks a free display and writes its number once it accepts connections (no polling).
        self.xvfb = subprocess.Popen(
            ["Xvfb", "-displayfd", str(write_fd), "-screen", "0", f"{width}x{height}x24", "-noreset",
             "-nolisten", "tcp", "-extension", "GLX"], pass_fds=(write_fd,), stdout=subprocess.DEVNULL)
        os.close(write_fd)
        number = b""
        while not number.endswith(b"\n"):
            chunk = os.read(read_fd, 16)
            if not chunk:
                raise RuntimeError(f"Xvfb exited with {self.xvfb.wait()} before accepting connections")
            number += chunk
        os.close(read_fd)
        self.name = f":{int(number)}"
        os.environ["DISPLAY"] = self.name
        from Xlib import X, XK, display
        from Xlib.ext import xtest
        self.X, self.XK, self.xtest = X, XK, xtest
        self.d = display.Display(self.name)
        self.root = self.d.screen().root
        self.atoms = {n: self.d.intern_atom(n) for n in (
            "_NET_CLIENT_LIST", "_NET_ACTIVE_WINDOW", "_NET_WM_NAME", "_NET_WM_PID", "UTF8_STRING",
            "_NET_SUPPORTING_WM_CHECK")}
        self.wm = subprocess.Popen([wm], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if wm else None
        deadline = time.monotonic() + 10
        while wm and self.root.get_full_property(self.atoms["_NET_SUPPORTING_WM_CHECK"], X.AnyPropertyType) is None:
            if self.wm.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"window manager {wm!r} did not start")
            time.sleep(0.02)
        self._spare = self._find_spare_keycodes()
        self._remapped: OrderedDict[int, int] = OrderedDict()  # keysym -> spare keycode

    def alive(self) -> dict:
        return {"xvfb": self.xvfb.poll() is None, "wm": self.wm is None or self.wm.poll() is None}

    # -- pointer and keyboard through XTEST
    def _clip(self, x: float, y: float) -> tuple[int, int]:
        x, y = int(round(x)), int(round(y))
        if not (0 <= x < self.width and 0 <= y < self.height):
            raise ActionFailure(f"point ({x}, {y}) is off the {self.width}x{self.height} screen")
        return x, y

    def move(self, x: float, y: float) -> None:
        x, y = self._clip(x, y)
        self.xtest.fake_input(self.d, self.X.MotionNotify, x=x, y=y)

    def click(self, x: float, y: float, button: int = 1, count: int = 1) -> None:
        self.move(x, y)
        for _ in range(count):
            self.xtest.fake_input(self.d, self.X.ButtonPress, button)
            self.xtest.fake_input(self.d, self.X.ButtonRelease, button)
        self.d.sync()

    def scroll(self, x: float, y: float, direction: str, amount: int) -> None:
        button = {"up": 4, "down": 5, "left": 6, "right": 7}.get(direction)
        if button is None:
            raise ActionFailure("direction must be up, down, left or right")
        self.move(x, y)
        for _ in range(max(1, min(int(amount), 50))):
            self.xtest.fake_input(self.d, self.X.ButtonPress, button)
            self.xtest.fake_input(self.d, self.X.ButtonRelease, button)
        self.d.sync()

    def drag(self, x1: float, y1: float, x2: float, y2: float) -> None:
        self.move(x1, y1)
        self.xtest.fake_input(self.d, self.X.ButtonPress, 1)
        self.d.sync()
        steps = 8  # intermediate motion: toolkits start a drag only after the pointer travels a few pixels
        for i in range(1, steps + 1):
            self.move(x1 + (x2 - x1) * i / steps, y1 + (y2 - y1) * i / steps)
            self.d.sync()
            time.sleep(0.01)
        self.xtest.fake_input(self.d, self.X.ButtonRelease, 1)
        self.d.sync()

    def _find_spare_keycodes(self) -> list[int]:
        first = self.d.display.info.min_keycode
        count = self.d.display.info.max_keycode - first + 1
        mapping = self.d.get_keyboard_mapping(first, count)
        spare = [first + i for i in range(count) if not any(mapping[i])]
        return spare or [self.d.display.info.max_keycode]  # none unused: borrow the last one

    def _keycode(self, keysym: int) -> tuple[int, bool]:
        """A keycode producing ``keysym`` and whether Shift is needed; maps it onto a spare keycode if none does."""
        for code, index in self.d.keysym_to_keycodes(keysym):
            if index in (0, 1):
                return code, index == 1
        if keysym in self._remapped:
            self._remapped.move_to_end(keysym)
            return self._remapped[keysym], False
        if len(self._remapped) < len(self._spare):
            code = self._spare[len(self._remapped)]
        else:
            # Reusing a keycode: a client still holding a key event for its old symbol would read the new one,
            # so give clients time to drain what was typed before remapping.
            self.d.sync()
            time.sleep(0.05)
            _, code = self._remapped.popitem(last=False)
        self.d.change_keyboard_mapping(code, [(keysym, keysym)])
        self.d.sync()
        time.sleep(0.005)  # clients must see the MappingNotify before the key event
        self._remapped[keysym] = code
        return code, False

    def _keysym(self, name: str) -> int:
        sym = self.XK.string_to_keysym(KEY_NAMES.get(name.lower(), name))
        if not sym and len(name) == 1:
            sym = self._char_keysym(name)
        if not sym:
            sym = self.XK.string_to_keysym(name.lower()) or self.XK.string_to_keysym(name.capitalize())
        if not sym:
            raise ActionFailure(f"unknown key {name!r}")
        return sym

    def _char_keysym(self, ch: str) -> int:
        if ch in CHAR_NAMES:
            return self.XK.string_to_keysym(CHAR_NAMES[ch])
        cp = ord(ch)
        return cp if 0x20 <= cp <= 0x7E or 0xA0 <= cp <= 0xFF else 0x01000000 | cp

    def _tap(self, code: int, shift: bool) -> None:
        shift_code = self.d.keysym_to_keycode(self.XK.string_to_keysym("Shift_L"))
        if shift:
            self.xtest.fake_input(self.d, self.X.KeyPress, shift_code)
        self.xtest.fake_input(self.d, self.X.KeyPress, code)
        self.xtest.fake_input(self.d, self.X.KeyRelease, code)
        if shift:
            self.xtest.fake_input(self.d, self.X.KeyRelease, shift_code)

    def type_text(self, text: str) -> None:
        for ch in text:
            if ch == "\r":
                continue
            code, shift = self._keycode(self._char_keysym(ch))
            self._tap(code, shift)
            self.d.sync()  # the server must not queue thousands of events before clients read them

    def hotkey(self, combo: str) -> None:
        names = [k.strip() for k in combo.replace(" ", "").split("+") if k.strip()] if combo != "+" else ["plus"]
        if not names:
            raise ActionFailure("hotkey needs keys such as 'ctrl+s'")
        codes = []
        for name in names:
            code, _ = self._keycode(self._keysym(name))
            codes.append(code)
        for code in codes:
            self.xtest.fake_input(self.d, self.X.KeyPress, code)
        for code in reversed(codes):
            self.xtest.fake_input(self.d, self.X.KeyRelease, code)
        self.d.sync()

    # -- pixels
    def screenshot(self, fmt: str, quality: int) -> bytes:
        img = self.root.get_image(0, 0, self.width, self.height, self.X.ZPixmap, 0xFFFFFFFF)
        if fmt == "raw":
            return img.data
        from PIL import Image
        pic = Image.frombuffer("RGB", (self.width, self.height), img.data, "raw", "BGRX", 0, 1)
        out = io.BytesIO()
        if fmt == "jpeg":
            pic.save(out, format="JPEG", quality=quality)
        elif fmt == "png":
            pic.save(out, format="PNG", compress_level=1)
        else:
            raise ActionFailure("screenshot format must be jpeg, png or raw")
        return out.getvalue()

    # -- windows
    def _title(self, win) -> str:
        try:
            prop = win.get_full_property(self.atoms["_NET_WM_NAME"], self.atoms["UTF8_STRING"])
            if prop is not None:
                return prop.value.decode("utf-8", "replace") if isinstance(prop.value, bytes) else str(prop.value)
            name = win.get_wm_name()
            return name.decode("latin-1") if isinstance(name, bytes) else (name or "")
        except Exception:
            return ""

    def windows(self) -> list[dict]:
        X = self.X
        prop = self.root.get_full_property(self.atoms["_NET_CLIENT_LIST"], X.AnyPropertyType)
        active = self.root.get_full_property(self.atoms["_NET_ACTIVE_WINDOW"], X.AnyPropertyType)
        active_id = active.value[0] if active is not None and len(active.value) else 0
        out = []
        for wid in (prop.value if prop is not None else []):
            win = self.d.create_resource_object("window", wid)
            try:
                cls = win.get_wm_class() or ("", "")
                pid_prop = win.get_full_property(self.atoms["_NET_WM_PID"], X.AnyPropertyType)
                geom = win.get_geometry()
                pos = win.translate_coords(self.root, 0, 0)
            except Exception:
                continue  # the window closed while we looked
            out.append({"id": int(wid), "title": self._title(win), "class": cls[1] if len(cls) > 1 else "",
                        "pid": int(pid_prop.value[0]) if pid_prop is not None else 0, "focused": wid == active_id,
                        "bounds": [-pos.x, -pos.y, geom.width, geom.height]})
        return out

    def focus(self, wid: int) -> None:
        from Xlib import protocol
        win = self.d.create_resource_object("window", wid)
        ev = protocol.event.ClientMessage(window=win, client_type=self.atoms["_NET_ACTIVE_WINDOW"],
                                          data=(32, [2, self.X.CurrentTime, 0, 0, 0]))
        mask = self.X.SubstructureRedirectMask | self.X.SubstructureNotifyMask
        self.root.send_event(ev, event_mask=mask)
        self.d.sync()

    def close(self) -> None:
        for proc in (self.wm, self.xvfb):
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in (self.wm, self.xvfb):
            if proc is not None:
                try:
                    proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    proc.kill()

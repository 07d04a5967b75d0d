"""A real case-insensitive, case-preserving filesystem for tests (as macOS's APFS by default, or an
SMB share): a FUSE passthrough over a backing directory, in which a name matches an existing entry
of any case (`Fox.png` opens, replaces or removes `fox.png`), and a new entry keeps the case it was
created with. Linux's own case folding (ext4/tmpfs `casefold`) needs a kernel built with
CONFIG_UNICODE, and vfat/exfat kernel modules, which a CI machine may lack; FUSE is in the kernel.

    with casefold_mount(tmp_path / "backing", tmp_path / "mnt") as mnt: ...

Needs fusepy (the `test` extra) and libfuse2 (`apt-get install libfuse2`), and root (or
fusermount) to mount; where any is missing, the test is skipped saying which. Run alone, this
file serves the mount in the foreground: `python casefold_fs.py BACKING MOUNTPOINT`.
"""
import contextlib
import errno
import os
import subprocess
import sys
import time

import pytest


class CaseFold:
    """fusepy `Operations` over `root`: each path component resolved to the existing entry whose
    name folds to the same (a directory listing per component: fine for the few files of a test).
    Attributes come from the backing files (the process runs as root; permissions are checked
    by the kernel with `default_permissions`)."""

    def __init__(self, root: str):
        self.root = root

    def _real(self, path: str) -> str:
        real = self.root
        for part in path.strip("/").split("/"):
            if not part:
                continue
            try:
                names = os.listdir(real)
            except OSError:
                names = []
            real = os.path.join(real, next((n for n in names if n.casefold() == part.casefold()),
                                           part))
        return real

    def __call__(self, op, path, *args):
        from fuse import FuseOSError
        fn = getattr(self, op, None)
        if fn is None:
            raise FuseOSError(errno.ENOSYS)
        try:
            return fn(path, *args)
        except OSError as e:
            raise FuseOSError(e.errno or errno.EIO) from None

    def init(self, path):
        pass

    def destroy(self, path):
        pass

    def getattr(self, path, fh=None):
        st = os.lstat(self._real(path))
        return {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid",
                                            "st_atime", "st_mtime", "st_ctime")}

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._real(path))]

    def access(self, path, mode):
        if not os.access(self._real(path), mode):
            raise OSError(errno.EACCES, "no access")

    def mkdir(self, path, mode):
        os.mkdir(self._real(path), mode)

    def rmdir(self, path):
        os.rmdir(self._real(path))

    def unlink(self, path):
        os.unlink(self._real(path))

    def rename(self, old, new):
        os.replace(self._real(old), self._real(new))

    def chmod(self, path, mode):
        os.chmod(self._real(path), mode)

    def chown(self, path, uid, gid):
        os.chown(self._real(path), uid, gid)

    def utimens(self, path, times=None):
        os.utime(self._real(path), times)

    def truncate(self, path, length, fh=None):
        os.truncate(self._real(path), length)

    def create(self, path, mode, fi=None):
        return os.open(self._real(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)

    def open(self, path, flags):
        return os.open(self._real(path), flags)

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        return os.pwrite(fh, data, offset)

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        os.fsync(fh)

    def release(self, path, fh):
        os.close(fh)

    def statfs(self, path):
        st = os.statvfs(self.root)
        return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize",
                                            "f_favail", "f_ffree", "f_files", "f_flag",
                                            "f_frsize", "f_namemax")}


@contextlib.contextmanager
def casefold_mount(backing, mountpoint, timeout_s: float = 10.0):
    """`mountpoint` as a case-insensitive filesystem over `backing` (both created), served by a
    child process and unmounted after; skips the test, with the reason, where it cannot mount."""
    try:
        import fuse  # noqa: F401  (fusepy; raises OSError where libfuse is not installed)
    except (ImportError, OSError) as e:
        pytest.skip(f"cannot mount a case-insensitive FUSE filesystem: {e} (needs fusepy and "
                    f"libfuse2: pip install fusepy; apt-get install libfuse2)")
    os.makedirs(backing, exist_ok=True)
    os.makedirs(mountpoint, exist_ok=True)
    proc = subprocess.Popen([sys.executable, __file__, str(backing), str(mountpoint)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None:
                pytest.skip(f"cannot mount a FUSE filesystem here (needs /dev/fuse and root or "
                            f"fusermount): {proc.stdout.read().strip()[-500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the FUSE mount at {mountpoint} did not come up in {timeout_s} s")
            time.sleep(0.05)
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], capture_output=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)


if __name__ == "__main__":
    from fuse import FUSE
    FUSE(CaseFold(os.path.abspath(sys.argv[1])), sys.argv[2], foreground=True, nothreads=True,
         default_permissions=True)

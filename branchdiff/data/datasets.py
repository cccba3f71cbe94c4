"""Public data sets the benchmarks and the recipes read, fetched once and checked (docs/benchmarks.md, "Data").

Each set is a few files of a public repository at a pinned commit. A file is fetched on first use, or ahead of time
by `branchdiff data fetch NAME` (an offline cluster: fetch on a machine that is online and copy the folder), into
`data_root()/NAME/` (`$BRANCHDIFF_DATA`, default `~/.cache/branchdiff`). A download goes to a partial file of its own
(`FILE.partial.PID.THREAD`: the processes of a launch fetch at once) and takes the file's name only once its bytes
match the pins: the git blob id the commit's tree names for it (SHA-1 over
"blob <size>\\0" and the bytes: every file has one) and its SHA-256 where recorded. So a partial or changed file is
never read: a cached file that no longer matches is fetched again, and where it cannot be, one line names the URL,
the file expected (its SHA-256 or blob id) and the folder to put it in. `$BRANCHDIFF_DATA_MIRROR` replaces
`https://raw.githubusercontent.com` in every URL (a mirror inside a cluster; the tests' local server).
"""

from __future__ import annotations

import hashlib
import os
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from branchdiff.errors import UserError, one_line

GITHUB_RAW = "https://raw.githubusercontent.com"
FETCH_TIMEOUT = 60.0  # seconds a download may wait for the server between bytes


@dataclass(frozen=True)
class RemoteFile:
    path: str  # the file's path in its repository (its name in the cache folder is the last part)
    git_blob: str  # the blob id the commit's tree names for it
    sha256: str = ""  # its SHA-256, where recorded ("": the blob id alone pins it)
    rows: int = 0  # prompts (lines, JSONL rows or list items) it holds, where it holds prompts

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class DataSet:
    repository: str  # owner/name on GitHub
    commit: str  # the commit every file is read at
    files: tuple[RemoteFile, ...]
    licence: str  # the licence of the files, as their repository states it
    about: str  # one line: what the set is and who uses it

    def url(self, file: RemoteFile) -> str:
        base = os.environ.get("BRANCHDIFF_DATA_MIRROR", GITHUB_RAW).rstrip("/")
        return f"{base}/{self.repository}/{self.commit}/{file.path}"

    def file(self, name: str) -> RemoteFile:
        found = [f for f in self.files if f.name == name]
        if not found:
            raise UserError(f"{self.repository}'s data set holds no file {name!r}; its files: {', '.join(f.name for f in self.files)}")
        return found[0]


GENEVAL_COMMIT = "af4902f24d3ca90ebbb446dd9891a59e0f82725f"
FLOW_GRPO_COMMIT = "ac4c86e8cae021841f1fde853d340e0db67690dd"
DATASETS: dict[str, DataSet] = {
    "geneval": DataSet("djghosh13/geneval", GENEVAL_COMMIT, (
        RemoteFile("prompts/evaluation_metadata.jsonl", "efc21c7e639cd45554a1e44fac87157211f16d51",
                   "5c48e0813e812e3c373fa5c8ed07a8f0a483be30272b4427b0559c8048e67c13", 553),
        RemoteFile("evaluation/object_names.txt", "f4822dd01d0d1d2598d5e0190c121204e55925f1",
                   "608f6a0e5c8ca1c7a92b818430141fe268c85b7930b50f4160f1d65893b5bacd")),
        "MIT (Dhruba Ghosh, 2023)", "GenEval's 553 prompts with their tags and objects, and the 80 COCO classes its detector names"),
    "flow-grpo-geneval": DataSet("yifan123/flow_grpo", FLOW_GRPO_COMMIT, (
        RemoteFile("dataset/geneval/train_metadata.jsonl", "0b97e8a6802c08fc7537cd00c76ae79c851bddcb"),
        RemoteFile("dataset/geneval/test_metadata.jsonl", "27cdaf5cc1356fe15aeadbb8df55682ca74228f0",
                   "cec4b24b9fee7bac21c8f787054ecc8dc9ff831674037713a4cd35e0f0a74a28", 2212)),
        "MIT (Jie Liu, 2025)", "Flow-GRPO's GenEval-style training prompts and its 2,212-prompt test split"),
    "flow-grpo-ocr": DataSet("yifan123/flow_grpo", FLOW_GRPO_COMMIT, (
        RemoteFile("dataset/ocr/train.txt", "3ce0521b77b0a9031191d66ecc36ebaaf27a3922"),
        RemoteFile("dataset/ocr/test.txt", "8deb4f8d8f2e863f45353354243669b3c991a6a2",
                   "4dd8caf3ab6ade73bd376c7d14c6ca49b6eacfb1bd321e22c40714ae4a98d4dc", 1018)),
        "MIT (Jie Liu, 2025)", "Flow-GRPO's visual text rendering prompts (text between double quotes) and its 1,018-prompt test split"),
    "flow-grpo-pickscore": DataSet("yifan123/flow_grpo", FLOW_GRPO_COMMIT, (
        RemoteFile("dataset/pickscore/train.txt", "a437bd921c03fbc00c4e7ce148ae2d28fcd6e49b",
                   "2f425adcbb9a6d0feee7c6c448e1cb83a1f71deca9434b803907e2578eca837f", 25432),
        RemoteFile("dataset/pickscore/test.txt", "45f05231b969fb5f74c8debd606b22cd3be27f8e",
                   "d75c025fa451866e70f7e36243f7cdd93095523cb51f5f9651f2ce3236d20262", 2048)),
        "MIT (Jie Liu, 2025)", "Flow-GRPO's Pick-a-Pic prompts for PickScore training and its 2,048-prompt test split"),
    "drawbench": DataSet("nousr/dream-bench", "0b39627b19c2297403de90878208daf15c8ac0ee", (
        RemoteFile("prompts/drawbench.json", "2676d67498985bf513ab567ad02c96f989da2af7",
                   "a64535eb9089a6064a4ebe5c9cd66a85b71164ca1dd637de5df68df81479947b", 200),),
        "MIT for the repository's copy; DrawBench itself is Imagen's (Saharia et al., 2022), published for research without a licence",
        "DrawBench's 200 prompts (Imagen), as a JSON list"),
    "dancegrpo-hpd": DataSet("XueZeyue/DanceGRPO", "15cc71d53cc2e6e18a68ee607d5fb6ba9a99e344", (
        RemoteFile("assets/prompts.txt", "b47234e475645222ca9a0bb7742ebf4d08123855"),),
        "Apache-2.0 (DanceGRPO)", "the HPD training prompts DanceGRPO and BranchGRPO train FLUX.1 on (BranchGRPO ships the same file)"),
    "mixgrpo-hpdv2-test": DataSet("Tencent-Hunyuan/MixGRPO", "e5cdd6a427778d8c8b2e7a48ce16972141adbe7c", (
        RemoteFile("data/prompts_test.txt", "69323d42374806447d4768a257f376a7db683e07",
                   "6eb1c5561a58da305155ba00755822de4f8b0bc239175e20334e431e978f4a82", 400),),
        "MixGRPO's own terms: academic research only, no commercial use (its License.txt)",
        "the 400 HPDv2 test prompts MixGRPO and BranchGRPO report HPS-v2.1, PickScore and ImageReward on"),
}


def data_root() -> Path:
    return Path(os.environ.get("BRANCHDIFF_DATA", Path.home() / ".cache" / "branchdiff"))


def folder_of(name: str) -> Path:
    return data_root() / name


def data_set(name: str) -> DataSet:
    if name not in DATASETS:
        raise UserError(f"no data set {name!r}; known: {', '.join(DATASETS)} (branchdiff data list)")
    return DATASETS[name]


def digests(data: bytes) -> tuple[str, str]:
    """(git blob id, SHA-256) of a file's bytes."""
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return blob, hashlib.sha256(data).hexdigest()


def matches(file: RemoteFile, data: bytes) -> bool:
    blob, sha256 = digests(data)
    return blob == file.git_blob and (not file.sha256 or sha256 == file.sha256)


def _expected(file: RemoteFile) -> str:
    return f"SHA-256 {file.sha256}" if file.sha256 else f"git blob {file.git_blob}"


def cached_path(name: str, file_name: str, fetch: bool = True) -> Path:
    """The checked local copy of `file_name` of data set `name`, fetched first when it is missing or does not match its
    pins (`fetch` False: a UserError instead). Raises UserError in one line (module doc) when it cannot be had."""
    data_set_ = data_set(name)
    file = data_set_.file(file_name)
    path = folder_of(name) / file.name
    if path.is_file() and matches(file, path.read_bytes()):
        return path
    where = f"put the file {file.name} ({_expected(file)}) from {data_set_.url(file)} into {path.parent}"
    if not fetch:
        state = "does not match its pins (a partial or changed copy)" if path.exists() else "is not there"
        raise UserError(f"data set {name}: {path} {state}; run branchdiff data fetch {name} where the network is reachable, or {where}")
    _download(data_set_, file, path, name, where)
    return path


def _download(data_set_: DataSet, file: RemoteFile, path: Path, name: str, where: str) -> None:
    """`file` fetched to `path` through a partial file of this process and thread (processes of one launch fetch at once),
    renamed only once it matches (module doc); one that another finished first is kept."""
    url = data_set_.url(file)
    partial = path.with_name(f"{path.name}.partial.{os.getpid()}.{threading.get_ident()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT) as response, partial.open("wb") as out:  # noqa: S310 (a pinned https URL)
            while chunk := response.read(1 << 20):
                out.write(chunk)
    except (urllib.error.URLError, OSError, ValueError) as error:
        partial.unlink(missing_ok=True)
        why = error.reason if isinstance(error, urllib.error.URLError) and not isinstance(error, urllib.error.HTTPError) else error
        raise UserError(f"data set {name}: {url} could not be fetched ({one_line(why, 120)}); {where}") from None
    data = partial.read_bytes()
    if not matches(file, data):
        blob, sha256 = digests(data)
        partial.unlink()
        size = len(data)
        raise UserError(f"data set {name}: {url} gave {size:,} bytes that do not match the pinned file (got SHA-256 {sha256}, git blob {blob}; "
                        f"a cut download or a changed file); nothing was kept; run again, or {where}")
    os.replace(partial, path)


def fetch(name: str) -> list[Path]:
    """Every file of data set `name`, fetched where missing or not matching; their paths."""
    return [cached_path(name, file.name) for file in data_set(name).files]


def status(name: str) -> list[tuple[RemoteFile, str]]:
    """Each file of `name` with its local state: "ok", "missing" or "does not match" (never fetches)."""
    states = []
    for file in data_set(name).files:
        path = folder_of(name) / file.name
        states.append((file, "missing" if not path.is_file() else "ok" if matches(file, path.read_bytes()) else "does not match"))
    return states

"""prima-node's command-line options, one constant each (main() names them; typer reads their help)."""

import typer

from nodes.ring.compute_pool import INLINE_S
from nodes.ring.work import MAX_BATCH, MAX_REQUESTS
from prima_rpc.channel import read_token


def token_from(path: str | None) -> str | None:
    try:
        return read_token(path)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


PEER = typer.Option("", help="HOST:PORT of the next node in the ring (or --join)")
JOIN = typer.Option("", help="HOST:PORT of any member of a running ring: join it (inserted before "
                                           "its head; it takes layers at the next re-plan)")
DISCOVER = typer.Option(False, help="announce this node on the LAN over mDNS (_prima._tcp); with "
                                                   "neither --peer nor --join, find a running ring and join it")
PORT = typer.Option(7000, help="port to serve on (0: any free port)")
HOST = typer.Option("0.0.0.0", help="address to bind")
MODEL = typer.Option(None, help="layer store directory (none: fetch the assigned layers from the "
                                               "ring's head into --cache; a relay loads nothing)")
CACHE = typer.Option(None, help="where weights fetched from other nodes are kept "
                                               "(default: $PRIMA_HOME/cache)")
NAME = typer.Option("", help="a name for status tables")
MEM_BUDGET = typer.Option("0", show_default=False,
                                        help="memory for weights, KV caches and the stream buffer, e.g. 2GiB "
                                             "(default, or 0: 80 % of the RAM available when windows are assigned)")
TOKEN = typer.Option(None, "--token-file", metavar="PATH", callback=token_from, show_default=False,
                                   help="a file holding the cluster secret (default: $PRIMA_TOKEN); never on the "
                                        "command line, where ps shows it")
DTYPE = typer.Option(None, help="compute dtype: float32 or bfloat16 (default: float32 for float "
                                               "stores; for int8/int4 the fastest this machine measures)")
KV_DTYPE = typer.Option("auto", help="how KV caches store rows: auto | float | int8 | int4 (int8, "
                                                   "int4: llama.cpp's q8_0, q4_0; auto: the plan's choice, else "
                                                   "float)")
CTX = typer.Option(0, min=0, help="KV positions (the context, all requests together) the memory "
                                                "budget keeps room for (0: the plan's, else the model's whole "
                                                "context under the default budget, 2048 under --mem-budget)")
METRICS_PORT = typer.Option(0, help="serve Prometheus metrics on this port at /metrics (0: off)")
TLS_CERT = typer.Option(None, help="serve TLS with this PEM certificate (needs --tls-key, --tls-ca)")
TLS_KEY = typer.Option(None, help="the certificate's PEM private key")
TLS_CA = typer.Option(None, help="PEM roots to trust when dialling the successor and ring members")
TLS_MUTUAL = typer.Option(False, help="require client certificates signed by --tls-ca")
DRAFT = typer.Option(None, help="a draft model store (same tokenizer) the head runs for "
                                                "speculative decoding with speculate=draft")
MAX_BATCH = typer.Option(MAX_BATCH, min=1, max=MAX_REQUESTS,
                                       help="frames of different requests one compute takes at most (a plan "
                                            "may set another)")
PREFIX_DISK = typer.Option("1GiB", help="disk for copies of cached prompt prefixes, which a restart "
                                                     "or a re-plan keeping a window loads instead of prefilling "
                                                     "(0: off)")
PREFIX_DIR = typer.Option(None, help="where those copies go (default: $PRIMA_HOME/prefixes)")
INLINE_MS = typer.Option(INLINE_S * 1e3, min=0, help="compute jobs last measured shorter run on "
                                         "the event loop, saving two thread hand-offs (0: always the thread)")
REPLAN = typer.Option("on", help="on: the head re-plans the ring live when a device gets busier or "
                                               "short of memory; off: the plan stays until prima-ctl start")
MAX_CPU = typer.Option(1.0, help="the share of this device's cores the node may use, e.g. 0.5 "
                                                 "(its compute threads, and the planner's view of it)")
MAX_MEMORY = typer.Option("0", show_default=False,
                                        help="memory the node may use: a size (2GiB) or a share of the memory "
                                             "available at start (50%); the planner respects it (default: no cap)")
NICE = typer.Option(False, "--nice", help="run at the lowest priority (nice 19, SCHED_IDLE): the "
                                                         "owner's apps win every contest for the CPU")
LOG_LEVEL = typer.Option("info")

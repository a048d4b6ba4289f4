"""Task generators, loaders and iterators: offline, seeded, sharded, checkpointable.

Sources are Grain random-access data sources (``len``, ``source[i] -> dict of numpy
arrays``); ``batches`` makes the Grain pipeline that shuffles, shards by process and batches
them, and ``DataIterator`` iterates it with a state dict that resumes exactly.
"""

from ._bytes import BYTE_VOCAB_SIZE as BYTE_VOCAB_SIZE
from ._bytes import ByteWindows as ByteWindows
from ._bytes import StdlibBytesClassification as StdlibBytesClassification
from ._bytes import encode_bytes as encode_bytes
from ._bytes import stdlib_bytes_lm as stdlib_bytes_lm
from ._bytes import stdlib_documents as stdlib_documents
from ._checks import check_arrays as check_arrays
from ._checks import check_range as check_range
from ._iterators import ArraySource as ArraySource
from ._iterators import DataIterator as DataIterator
from ._iterators import batches as batches
from ._iterators import materialize as materialize
from ._listops import ListOps as ListOps
from ._listops import VOCAB as LISTOPS_VOCAB
from ._listops import VOCAB_SIZE as LISTOPS_VOCAB_SIZE
from ._listops import encode as encode_listops
from ._listops import evaluate as evaluate_listops
from ._listops import random_expression as random_listops_expression
from ._listops import tokenize as tokenize_listops
from ._loaders import load_aan as load_aan
from ._loaders import load_cifar10 as load_cifar10
from ._loaders import load_enwik8 as load_enwik8
from ._loaders import load_imdb as load_imdb
from ._loaders import load_listops_tsv as load_listops_tsv
from ._packing import PackedDocuments as PackedDocuments
from ._pathfinder import DIFFICULTIES as PATHFINDER_DIFFICULTIES
from ._pathfinder import PATHX_SIZE as PATHX_SIZE
from ._pathfinder import Pathfinder as Pathfinder
from ._pathfinder import draw_pathfinder as draw_pathfinder
from ._streams import StreamBatches as StreamBatches
from ._synthetic import InductionHeads as InductionHeads
from ._synthetic import MultiQueryAR as MultiQueryAR
from ._synthetic import SelectiveCopying as SelectiveCopying
from ._synthetic import power_law_probs as power_law_probs

"""Architecture-level variants: models whose change is in how blocks, tokens and layers are
arranged rather than in one attention kind (Swin's shifted windows and patch merging, Lite
Transformer's long-short range attention)."""

from ._lite import LSRA as LSRA
from ._lite import lightweight_conv as lightweight_conv
from ._swin import PatchMerging as PatchMerging
from ._swin import SwinBlock as SwinBlock
from ._swin import SwinClassifier as SwinClassifier
from ._swin import WindowAttention as WindowAttention
from ._swin import window_groups as window_groups

"""Model families, one module each (`latte`, `pixart`, `sd21`, `wan`, `wan22`, `wan_i2v`,
`flux`, `anyflow`), one `Family` record per family (`record.py`) in the plain dict `FAMILIES`; `PRESETS` maps
a preset name (conf/models/) to its family. Adding a family: write its module, add it to the tuple
below, add conf/models/<preset>.yaml (and a job in jobs/). docs/adding-a-family.md;
docs/models.md lists them all.
"""

from __future__ import annotations

from . import anyflow, flux, latte, pixart, sd21, wan, wan22, wan_i2v
from .record import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (latte.LATTE, pixart.ALPHA, pixart.SIGMA,
                                                     sd21.SD21, wan.WAN21, wan22.WAN22_A14B,
                                                     wan22.WAN22_TI2V, wan22.WAN22_I2V_A14B,
                                                     wan_i2v.WAN21_I2V,
                                                     flux.FLUX1_DEV, anyflow.ANYFLOW)}
PRESETS: dict[str, Family] = {p: f for f in FAMILIES.values() for p in f.presets}
DEFAULT_PRESET = "pixart_alpha_1024"   # model.preset when neither job nor command line sets one

__all__ = ["DEFAULT_PRESET", "FAMILIES", "PRESETS", "Family"]

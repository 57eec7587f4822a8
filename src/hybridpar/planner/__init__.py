"""The planner: what a layout costs in memory and time on a cluster, and which layout to run.

Six rooms, each importing only the rooms listed after it (``lint-imports`` checks this; the
contract is in ``pyproject.toml``, ``docs/architecture.md`` draws it):

* ``front/``: the doors: ``hybridpar plan`` (:mod:`.front.cli`; it imports no torch) and
  ``hybridpar calibrate`` (:mod:`.front.calibrate_cli`),
  ``hybridpar train --parallel.auto`` (:mod:`.front.auto`), what ``plan`` explains
  (:mod:`.front.explain`) and learning from runs (:mod:`.front.fit`);
* ``search/``: enumerate layouts, reject and rank them (:mod:`.search.search`), a candidate's
  options that fit (:mod:`.search.fitting`), and each layout's cp mode (:mod:`.search.cp_modes`);
* ``price/``: step time (:mod:`.price.cost`, its data-parallel terms :mod:`.price.dp_cost`, cp
  :mod:`.price.cp`, FP8 :mod:`.price.fp8`, pipeline makespans :mod:`.price.pipesim`, shared
  rates :mod:`.price.rates`) and the bytes on the wire per axis (:mod:`.price.traffic`, a
  layer's tp-region, MoE and MTP terms :mod:`.price.layer_traffic`);
* ``memory/``: per-rank device memory (:mod:`.memory.plan`), activation bytes
  (:mod:`.memory.activations`), activation offload (:mod:`.memory.offload`), the schedule's
  peak micro-batch counts (:mod:`.memory.peaks`) and the buffers of collectives in flight
  (:mod:`.memory.comm`);
* ``model/``: what is planned: the layout and workload and their bridge to the config rules
  (:mod:`.model.layout`), the parameter shapes each rank holds (:mod:`.model.shapes`), the MoE
  terms (:mod:`.model.moe`), op-level selective AC (:mod:`.model.sac`) and the HSDP groups
  (:mod:`.model.hsdp`);
* ``machine/``: the device and cluster the models divide by (:mod:`.machine.hardware`), kernel
  efficiency (:mod:`.machine.efficiency`), allocator overhead (:mod:`.machine.allocator`), the
  search's memo keyed by device or cluster (:mod:`.machine.memo`), the profile file
  (:mod:`.machine.profile`) and the measurements behind ``calibrate`` (:mod:`.machine.calibrate`,
  :mod:`.machine.probes`);

and :mod:`.errors`, the planner's one error, below them all.
"""

"""The upstream sources the patches and the DSBD engine's subclasses rely on, pinned by hash.

``tests/test_patches.py`` resolves every key and fails when vLLM's source
under a patch (:data:`UPSTREAM_SHA256`) or under a subclassed method
(:data:`SUBCLASSED_SHA256`) no longer hashes the same: upstream moved, and the
patch must be re-checked.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

from vllm_dsbd.engine.upstream import original as _original

#: sha256 of ``inspect.getsource`` of every upstream function a patch wraps
#: or replaces (vLLM 0.32.0). A mismatch means the patch must be re-checked.
UPSTREAM_SHA256 = {
    "vllm.config.speculative.SpeculativeConfig.__post_init__": (
        "aff56b18ad15a2a8e2b354066f790fd62617db5e67edf4d4e3ce49caea84d3ac"
    ),
    "vllm.config.speculative.SpeculativeConfig.uses_draft_model": (
        "26307ee92b9c36e2cdd61a656c9592d0dc84360f9467dc167910441b0e117983"
    ),
    "vllm.engine.arg_utils.EngineArgs.add_cli_args": (
        "0b7444570415c68c90cbf8636cc15988c3bab33438acd65dbc75c26c125e5cba"
    ),
    "vllm.engine.arg_utils.EngineArgs.create_engine_config": (
        "b9b94288f46d2f679c3f30825ddd2eb3b1f6a9958115c80505c4c948b972150f"
    ),
    "vllm.v1.engine.input_processor.InputProcessor.process_inputs": (
        "e22b5f772979054c158de62fa720f7a03db03382a91902852c9148d0144cd27b"
    ),
    "vllm.sampling_params.SamplingParams._verify_greedy_sampling": (
        "529c7d627c6fffd5b7cea3f0f7a4a46dec242fa5089429f9944bc6db1ff5e433"
    ),
    "vllm.entrypoints.generate.beam_search.offline.BeamSearchOfflineMixin.beam_search": (
        "b4b93229fd76b6a8bc9cbaafe3c57b58560698e1f30bed2ddd96e12f5378fc5f"
    ),
    "vllm.entrypoints.cli.main.main": (
        "a061e992b31c90884fb2c624d652464e98c78b81a7d5aded0d1e64ee73bc0061"
    ),
    "vllm.v1.metrics.loggers.PrometheusStatLogger.__init__": (
        "5c8762320d3946c6d937621b8fad25afd6b961167a7ab8cfae8c32ac00feab9e"
    ),
    "vllm.v1.spec_decode.metrics.SpecDecodingProm.__init__": (
        "19394ee2fea8a587f8b300ef15c44eb839cd587e2d2b19be83ff3dddcf4b1b4e"
    ),
    "vllm.v1.spec_decode.metrics.SpecDecodingProm.observe": (
        "04f9e651e9a19fcf27f4d179f4c811b2374e883c9ffcf27da8716e9f1a8c488c"
    ),
    "vllm.v1.spec_decode.metrics.SpecDecodingLogging.observe": (
        "81efa930a8a0d2709ad67cb76af606c41c9730ff79b487275dc1dd6b72c98819"
    ),
    "vllm.entrypoints.generate.beam_search.online.BeamSearchOnlineMixin.beam_search": (
        "e2e6d1893a8f2c1d8109f31994a108c5ecc88752a7129d3d68be27ac0a49091d"
    ),
    "vllm.entrypoints.openai.completion.protocol.CompletionRequest.to_beam_search_params": (
        "a1d956e4e6f9f7e7ab40761e19d1de4514176fcd94c11158946c1be7c3df664a"
    ),
    "vllm.entrypoints.openai.chat_completion.protocol.ChatCompletionRequest.to_beam_search_params": (
        "811f6b3777f9c523df5a0885804a349971e5e82619062e5b730436d233812c32"
    ),
}

#: sha256 of upstream functions the DSBD scheduler, runner and workers
#: override or depend on (they subclass rather than patch, but rely on how
#: these behave: SchedulerOutput layout, the order of finished/new request
#: handling and block copies in the worker, the discard mask, ...).
SUBCLASSED_SHA256 = {
    "vllm.v1.core.sched.scheduler.Scheduler.schedule": (
        "da4f2cf2fc39c39e76fdefa09b755d72d6b51d39fdc26830f0859ea688ded2ca"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler.update_from_output": (
        "85b29db96051135c2e8efcb26637eb46d30b8b7707e947ccf4f86f6fdc613c49"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler.add_request": (
        "fa2b51cd04a909775622d085b0f9ff4059cdf0c2e0d411f0aad2ff3c36e74acc"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler.finish_requests": (
        "b7a4ef7b8aa588bf394aed5f487a02d8e934da1366e25757446b05198007f996"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler._make_cached_request_data": (
        "8aeb1dc3ba937dd2996c0d0d1fafc06b0b00cf17fa1ef23f14f03c64f1ffacc7"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler._free_request": (
        "1b386dca84e6bb7308e3531e4ceb53789eab846db6211784eb49a8d9b4ebc7e7"
    ),
    "vllm.v1.core.kv_cache_manager.KVCacheManager.take_kv_cache_block_copies": (
        "807042512478e8f2c74e1ad969954b683e3c61db7dd7255282d549155ca49bf9"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample": (
        "5cb5c1da02cfdc689acb7bab51ca7eb56e2ef3b19bea4b92fc6ca4370be2cf5a"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync": (
        "13c3e81003a7e168f5cd7a0a04bbc70b16d6c54c18ae4edbf41a45f73c3b6ea1"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._update_states": (
        "326599f31b273b945fd7fc488f5e022c3b2d98d34fb74d2e9ce546e2abcdc892"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.sample_tokens": (
        "047e6a4738dead564fe9b997672e5737a9af3514a1b07fbc87c9f7df6a372d1b"
    ),
    "vllm.v1.worker.cpu_worker.CPUWorker.init_device": (
        "11721464aeb0de34c17055fee454c78485fe0470af47cdbfe74ee7cd1a42474d"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler._preempt_request": (
        "4113f5de8a84ec2532821578e8e3fb6ca4609b14d3d77b4a57d2b641ca427902"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler.make_stats": (
        "8963d2ab6518f994b0bf81bd682b4a9d665953c7bedb094cd565bb1cb6d04de2"
    ),
    "vllm.v1.core.sched.scheduler.Scheduler._update_after_schedule": (
        "2b527eb8070d3cce3510708df6df669d22ed2a6681261d84d0cb43c641036d07"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model": (
        "e058bf791a298e988db79e75c180c5474cd4884623d87c8fe600a89b6289d1aa"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids": (
        "a60269aca9de4e251b8132aa1d95de38497b65bfdb20fbb54596fe4d5600ad35"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.take_draft_token_ids": (
        "21e3697c8c5f9a817a05cb97c90c8c535eaf6b50ac15f532139457d4530096d8"
    ),
    "vllm.v1.sample.rejection_sampler.RejectionSampler.parse_output": (
        "6090d9b983277064f4a03971da5d9311747506b482e6357787f28fbe9c2cb81c"
    ),
    "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer.model_returns_tuple": (
        "28dd9a9eea577339cb44e71a7b27ced8819500c25de004ca4b3837d868706b46"
    ),
    "vllm.v1.worker.gpu_worker.Worker._make_model_runner": (
        "3817214704e1e262501988b3355525be27d1a61424ff9db1da1be11016fa2be4"
    ),
    # engine.draft_head replaces _apply_head on the draft's LogitsProcessor instance (draft_vocab_size)
    "vllm.model_executor.layers.logits_processor.LogitsProcessor._get_logits": (
        "9556236747c98a0f242ddda23bf1ce2cdb190983b685d06c51216a079b3625a7"
    ),
    "vllm.model_executor.layers.logits_processor.LogitsProcessor._apply_head": (
        "8c6519d221de62f8b94190317a8a1fadf17ae4f7c374c03ec95bb0a5a9877e2a"
    ),
    # engine.eagle3 / the runner with an EAGLE-3 head: aux export set up at load, the head's forward, logits
    # (d2t) and fc, its dummy runs, the rotary override, and the slot mapping the feature cache mirrors
    "vllm.config.speculative.SpeculativeConfig._maybe_override_draft_max_position_embeddings": (
        "a4f9f88dce485354c90a182a0050262282c489fc7ea17ad9b3e5b420b1b2fcf5"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._setup_eagle3_aux_hidden_state_outputs": (
        "6949a4e7f0621b9b117f8920f57ccdb1bd4080045c619349530520f4b77ca1e1"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._get_eagle3_aux_layers_from_config": (
        "2e4fd621ab179c36f6d243022bb873ebf505bd7c67b5357590f59e29b3078e2a"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._model_forward": (
        "a8f98588a4656ef66b79d7c763ab95e763b54b8d5b0af6ddde3ee85f02453113"
    ),
    "vllm.v1.worker.cpu_model_runner.CPUModelRunner.load_model": (
        "270bdfc6670d8cba1cd407cb903f5ef9dc94a1ea896ebf27bfeca2c8da2b1470"
    ),
    "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer.dummy_run": (
        "5e2e533fb829b33490c462ee2041d66dbc02ca5ed306cb4ffa90d35fe494c1f2"
    ),
    "vllm.model_executor.models.llama_eagle3.LlamaModel.__init__": (
        "fecf0e5cca40dfd5877998bf0300141fa78bfed85fc2f0bd978d49786f0c010b"
    ),
    "vllm.model_executor.models.llama_eagle3.LlamaModel.forward": (
        "504d2a14ea271ce67628a0f088ed6acf61b5984628d2a81900ad9ae2965e016d"
    ),
    "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM.compute_logits": (
        "0af3f208eb38b6ef255272e053f9e3d434c6b643bff314a2bd672f06668e3436"
    ),
    "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM.combine_hidden_states": (
        "a5eedb3b0f5b6e959e195173f5b5f9bf74b38fde01a340b9c96d8659eb7d18e1"
    ),
    "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM.load_weights": (
        "58eb0277207bf0100ea82d56518d024f4023149276f9a90abeff05b444fb3c2f"
    ),
    "vllm.model_executor.models.interfaces.EagleModelMixin._maybe_add_hidden_state": (
        "95b3f566fbd129d791621a3d589fc87a7f2f5b8e024e339a6879aa04677812ee"
    ),
    "vllm.v1.worker.block_table.BlockTable.compute_slot_mapping": (
        "1090515a52c58b28bce5fb3f80074899563503a411e31b89ecfab07940ae8e4e"
    ),
}

def source_sha256(fn: Any) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


def upstream_function(qualname: str) -> Any:
    """Resolve a :data:`UPSTREAM_SHA256` key to the upstream function."""
    import importlib

    module, owner, name = qualname.rsplit(".", 2)
    try:  # a module-level function: "package.module.function"
        return getattr(importlib.import_module(f"{module}.{owner}"), name)
    except ModuleNotFoundError:  # a method: "package.module.Class.method"
        return _original(getattr(importlib.import_module(module), owner), name)

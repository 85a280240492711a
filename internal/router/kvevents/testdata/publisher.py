"""vLLM's own KV events publisher, driven by TestFollowsVLLMsPublisher: each line on stdin is a
step, each answer a line on stdout after ANSWER (vLLM 0.30.0 logs to stdout too)."""

import sys
import time

import msgspec
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

endpoint, replay = sys.argv[1], sys.argv[2]


# A small replay buffer, so that the test can lose more than it holds.
BUFFER = 4


def publisher() -> ZmqEventPublisher:
    return ZmqEventPublisher(
        data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay, topic="kv",
        buffer_steps=BUFFER,
    )


class Dropped:
    """Stands in for the PUB socket while batches are lost on the way: the publisher numbers
    and buffers them for replay as it does every batch, and no subscriber gets them."""

    def send_multipart(self, *args, **kwargs) -> None:
        pass


def lose(pub, batches) -> None:
    real, pub._pub = pub._pub, Dropped()
    for events in batches:
        publish(pub, *events)
    time.sleep(0.5)
    pub._pub = real


def stored(hashes, parent, tokens, size=4) -> BlockStored:
    # Only the fields this release's BlockStored has (they grow from release to release).
    fields = {f.name for f in msgspec.structs.fields(BlockStored)}
    args = dict(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
        block_size=size, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
    )
    return BlockStored(**{k: v for k, v in args.items() if k in fields})


def removed(hashes) -> BlockRemoved:
    fields = {f.name for f in msgspec.structs.fields(BlockRemoved)}
    args = dict(block_hashes=hashes, medium="GPU", group_idx=0)
    return BlockRemoved(**{k: v for k, v in args.items() if k in fields})


def publish(pub, *events) -> None:
    pub.publish(KVEventBatch(ts=time.time(), events=list(events)))


ANSWER = "publisher: "


def answer(word: str) -> None:
    print(ANSWER + word, flush=True)


pub = publisher()
# Before anyone listens: only the replay buffer keeps these, and more of them than it holds
# (an engine that ran long before the router listened): the first falls out of it.
for i in range(BUFFER - 1):
    publish(pub, stored([700 + i], None, list(range(200 + 4 * i, 204 + 4 * i))))
publish(pub, stored([101, 102], None, list(range(0, 8))))
publish(pub, stored([103], 102, list(range(8, 12))))
time.sleep(0.5)
answer("history")
for line in sys.stdin:
    step = line.strip()
    if step == "evict":
        publish(pub, removed([102]))
    elif step == "store":
        publish(pub, stored([201], None, list(range(50, 54))))
    elif step == "gap":
        # One batch lost in transit, then one that arrives: replay fills the gap.
        lose(pub, [[stored([401], None, list(range(80, 84)))]])
        publish(pub, stored([402], 401, list(range(84, 88))))
    elif step == "loss":
        # More batches lost than the buffer holds, then one that arrives.
        lose(pub, [[removed([401])]] + [[stored([500 + i], None, [i] * 4)] for i in range(BUFFER)])
        publish(pub, stored([601], None, list(range(90, 94))))
    elif step == "clear":
        publish(pub, AllBlocksCleared())
    elif step == "restart":
        # A new engine process: a new publisher on the same ports, its sequence from 0. Give
        # the subscriber time to reconnect before its first batch.
        pub.shutdown()
        time.sleep(0.5)
        pub = publisher()
        time.sleep(3)
        publish(pub, stored([301], None, list(range(70, 74))))
    elif step == "quit":
        answer(step)
        break
    time.sleep(0.2)
    answer(step)
pub.shutdown()

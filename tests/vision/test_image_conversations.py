"""Conversations with several images (``layout="chat"``): rendered with the processor's chat template,
each image's placeholders where its image part is, labels on the assistant's tokens only, the images in
order; equal to the processor's own call for a fixed-count (LLaVA) and a size-dependent (Qwen2-VL)
processor, one a row and packed; bad conversations by the policy."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from transformers import AutoProcessor, AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

from datamodules import ImageTextDataModule
from tests.vision.image_data import tokenizer_for
from tests.vision.test_dynamic_resolution import image, png
from tests.vision.test_image_text import llava_processor

TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: {% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %} {% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def turn(role: str, *parts: str | int) -> dict:
    """A message: texts, and images by number."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "text": None} for p in parts]
    return {"role": role, "content": content}


# Conversations and their images' numbers in order; the assistant says "answer N ...".
CONVERSATIONS = [
    [turn("user", 0, "describe the picture"), turn("assistant", "answer 0 red circle")],
    [turn("user", "picture 1 and", 1, 2, "which is blue"), turn("assistant", "answer 1 the second"),
     turn("user", 3, "and this one"), turn("assistant", "answer 2 square")],
    [turn("user", "no picture here"), turn("assistant", "answer 3 only text")],
    [turn("user", 4, 5, 6, 7), turn("assistant", "answer 4 four pictures")],
]  # fmt: skip


def images_of(conversation: list[dict]) -> list[int]:
    numbers = iter(range(100))
    seen = []
    for message in conversation:
        for part in message["content"]:
            if part["type"] == "image":
                seen.append(next(numbers))
    return seen


def numbered(conversations: list[list[dict]]) -> tuple[list[list[dict]], list[list[int]]]:
    """The conversations, and each one's image numbers (counting on from the last conversation's)."""
    start, out = 0, []
    for conversation in conversations:
        count = len(images_of(conversation))
        out.append(list(range(start, start + count)))
        start += count
    return conversations, out


def save(root: Path, conversations: list[list[dict]], images: list[list[int]], bad: bytes | None = None) -> Path:
    rows = {
        "messages": conversations,
        "images": [[{"bytes": bad if bad is not None and k == 0 else png(k), "path": None} for k in ks]
                   for ks in images],
    }  # fmt: skip
    features = datasets.Features(
        {
            "messages": datasets.List(
                {"role": datasets.Value("string"),
                 "content": datasets.List({"type": datasets.Value("string"), "text": datasets.Value("string")})}
            ),
            "images": datasets.List(datasets.Image()),
        }
    )  # fmt: skip
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(root / "chats")
    return root / "chats"


@pytest.fixture(scope="module")
def processors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("processors")
    tokenizer = tokenizer_for(root / "tok")
    qwen = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=28 * 28 * 12),
        tokenizer=AutoTokenizer.from_pretrained(tokenizer),
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=TEMPLATE,
    )
    qwen.save_pretrained(root / "qwen")
    return {"llava": llava_processor(root, tokenizer), "qwen2-vl": root / "qwen", "tokenizer": Path(tokenizer)}


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("chats"), *numbered(CONVERSATIONS))


def datamodule(path: Path, processor: Path, **kw: object) -> ImageTextDataModule:
    options = {"layout": "chat", "text_field": "messages", "image_field": "images", "max_text_len": 192,
               "batch_size": 4, **kw}  # fmt: skip
    dm = ImageTextDataModule(str(path), processor=str(processor), **options)
    dm.setup("fit")
    return dm


def theirs(processor, conversation: list[dict], numbers: list[int]) -> dict:
    text = processor.apply_chat_template(conversation, tokenize=False)
    return processor(text=text, images=[image(k) for k in numbers] or None, return_tensors="pt")


def pixels_of_each(batch: dict, processor_kind: str) -> list[torch.Tensor]:
    if "image_grid_thw" in batch:
        return list(torch.split(batch["pixel_values"], batch["image_grid_thw"].prod(dim=1).tolist()))
    return list(batch["pixel_values"])


@pytest.mark.parametrize("kind", ["llava", "qwen2-vl"])
def test_conversations_equal_the_processors_own_call_and_learn_only_the_assistants_tokens(
    chats: Path, processors: dict[str, Path], kind: str
) -> None:
    processor = AutoProcessor.from_pretrained(processors[kind])
    _, numbers = numbered(CONVERSATIONS)
    dm = datamodule(chats, processors[kind])
    (batch,) = list(dm.train_dataloader())
    images = pixels_of_each(batch, kind)
    tokenizer = processor.tokenizer
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    seen = set()
    for row in range(4):
        ids = batch["input_ids"][row][batch["attention_mask"][row].bool()]
        index = next(
            i for i, c in enumerate(CONVERSATIONS) if len(ids) == len(theirs(processor, c, numbers[i])["input_ids"][0])
        )
        seen.add(index)
        own = theirs(processor, CONVERSATIONS[index], numbers[index])
        assert ids.tolist() == own["input_ids"][0].tolist()
        mine = [i for i, r in enumerate(batch["image_sample_index"].tolist()) if r == row]
        assert len(mine) == len(numbers[index])
        if mine:
            assert torch.equal(torch.cat([images[i] for i in mine]) if kind == "qwen2-vl" else torch.stack(
                [images[i] for i in mine]), own["pixel_values"])  # fmt: skip
        # Labels: the next token, only where it is the assistant's (never the prompt, a placeholder, padding).
        labels = batch["labels"][row]
        targets = labels[labels != -100]
        assert image_id not in targets.tolist()
        learned = tokenizer.decode(targets)
        said = [p["text"] for m in CONVERSATIONS[index] if m["role"] == "assistant" for p in m["content"]]
        assert all(s.replace(" ", "") in learned.replace(" ", "") for s in said)
        for m in CONVERSATIONS[index]:
            if m["role"] == "user":
                for part in m["content"]:
                    if part["type"] == "text":
                        assert part["text"].replace(" ", "") not in learned.replace(" ", "")
        at = torch.nonzero(labels != -100).flatten()
        assert torch.equal(labels[at], batch["input_ids"][row][at + 1])  # shifted: the next token
    assert seen == {0, 1, 2, 3}


def test_packed_conversations_are_each_as_they_are_alone(chats: Path, processors: dict[str, Path]) -> None:
    alone = datamodule(chats, processors["qwen2-vl"], batch_size=1)
    dm = datamodule(chats, processors["qwen2-vl"], pack_sequences=True, max_text_len=256, batch_size=1)
    train = dm._train
    rows = np.arange(len(train))
    batch = train.to_batch(train.fetch(rows, np.zeros(len(rows), dtype=np.uint64), np.zeros(len(rows), dtype=np.int64)))
    for r, members in enumerate(train.documents(rows, np.zeros(len(rows), dtype=np.int64))):
        at = 0
        for index in members.tolist():
            own = alone._train.to_batch(alone._train.fetch(np.array([index]), np.zeros(1, dtype=np.uint64)))
            n = int(own["attention_mask"].sum())
            assert torch.equal(batch["input_ids"][r, at : at + n], own["input_ids"][0, :n])
            assert torch.equal(batch["labels"][r, at : at + n], own["labels"][0, :n])
            at += n
    assert len(batch["image_grid_thw"]) == 8


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"images": lambda ks: ks[:-1]}, r"its messages hold 1 image parts for 0 images"),
        ({"bad": b"not an image"}, r"not an image format PIL can read"),
        ({"messages": lambda c: c[:1]}, r"it has no assistant turn to learn"),
    ],
    ids=["image-parts-without-images", "undecodable-image", "no-assistant-turn"],
)
def test_a_bad_conversation_raises_naming_it_or_is_replaced_and_counted(
    tmp_path: Path, processors: dict[str, Path], change: dict, reason: str
) -> None:
    first = CONVERSATIONS[0]
    conversations, numbers = numbered([first] + CONVERSATIONS[2:3] * 7)
    if "messages" in change:
        conversations = [change["messages"](first)] + conversations[1:]
    if "images" in change:
        numbers = [change["images"](numbers[0])] + numbers[1:]
    path = save(tmp_path, conversations, numbers, change.get("bad"))
    with pytest.raises(Exception, match=rf"row 0: {reason}"):
        list(datamodule(path, processors["llava"], batch_size=8).train_dataloader())
    dm = datamodule(path, processors["llava"], batch_size=8, on_bad_sample="skip")
    (batch,) = list(dm.train_dataloader())
    assert len(dm.bad_samples.reasons) == 1 and len(batch["pixel_values"]) == 0  # stand-ins: text-only chats


def test_a_template_that_cannot_place_images_is_refused_at_setup(chats: Path, processors: dict[str, Path]) -> None:
    tokenizer = str(processors["tokenizer"])
    plain = AutoTokenizer.from_pretrained(tokenizer)
    plain.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    plain.save_pretrained(processors["tokenizer"].parent / "plain")
    dm = ImageTextDataModule(str(chats), tokenizer=str(processors["tokenizer"].parent / "plain"), layout="chat",
                             text_field="messages", image_field="images", image_token="<image>",
                             num_image_tokens=4, max_text_len=64, batch_size=2)  # fmt: skip
    with pytest.raises(ValueError, match="does not render content parts"):
        dm.setup("fit")


@pytest.mark.parametrize("option", [{"add_bos": True}, {"separator": " "}, {"loss_before_first_image": False}])
def test_document_options_are_refused_for_conversations_naming_them(chats: Path, option: dict) -> None:
    with pytest.raises(ValueError, match=rf"\['{next(iter(option))}'\] cannot be combined with layout='chat'"):
        ImageTextDataModule(str(chats), tokenizer="x", layout="chat", text_field="messages", image_field="images",
                            image_token="<image>", num_image_tokens=4, max_text_len=64, batch_size=2,
                            **option)  # fmt: skip

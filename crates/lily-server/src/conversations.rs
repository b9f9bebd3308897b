//! OpenAI's Conversations API: a conversation is a list of items (messages, reasoning, function calls and their
//! outputs, as the Responses API takes them) that the server keeps. A response created with `conversation` reads
//! the conversation's items before its own input, and once it has completed, its input and output items are added
//! to the conversation. Conversations live in memory, up to `--response-store-mib` of them (apart from the kept
//! responses), the least recently used dropped first, until the server restarts.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value as Json};

use crate::error::ApiError;
use crate::lru::Lru;
use crate::params;
use crate::responses;
use crate::types::{ConversationObject, InputItemsQuery, ItemList};

/// The most items one request may add (OpenAI's limit), and the most metadata pairs and their lengths.
const MAX_ADDED_ITEMS: usize = 20;
const MAX_METADATA_PAIRS: usize = 16;
const MAX_METADATA_KEY: usize = 64;
const MAX_METADATA_VALUE: usize = 512;

struct Conversation {
    object: ConversationObject,
    /// Oldest first, each with an `id` of its own.
    items: Vec<Json>,
    /// The items' ids, kept beside them so that a change checks its new ids without reading every item.
    ids: HashSet<String>,
    /// What the store counts it for: its metadata's and items' [`json_bytes`]. A change adds or takes off what it
    /// changes, so that a long conversation is not measured again at every turn.
    bytes: usize,
}

impl Conversation {
    /// A conversation of `items`, counted once here: its metadata's and items' JSON, and for each item what
    /// holding it costs beyond its text.
    fn new(object: ConversationObject, items: Vec<Json>) -> Conversation {
        let bytes = json_bytes(&object.metadata) + items.iter().map(json_bytes).sum::<usize>();
        Conversation {
            object,
            ids: items.iter().filter_map(item_id).collect(),
            items,
            bytes,
        }
    }

    /// Appends items whose ids no item of the conversation has (as [`responses::normalized`] makes them).
    fn extend(&mut self, items: impl IntoIterator<Item = Json>) {
        for item in items {
            self.ids.extend(item_id(&item));
            self.items.push(item);
        }
    }
}

/// What one item (or the metadata) counts for: its JSON text and what holding it costs beyond that.
fn json_bytes(v: &Json) -> usize {
    serde_json::to_vec(v).map_or(0, |v| v.len()) + crate::lru::ENTRY_OVERHEAD
}

/// The kept conversations, and those a response is using (which take no other response, and are never dropped
/// for room, until it ends).
pub struct ConversationStore {
    inner: Mutex<Lru<Conversation>>,
    busy: Mutex<HashSet<String>>,
}

/// A conversation's hold by the response that uses it; dropped, the conversation takes responses again.
pub struct Busy {
    store: Arc<ConversationStore>,
    id: String,
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.store.lock_busy().remove(&self.id);
    }
}

impl ConversationStore {
    /// A store that holds up to `capacity_bytes` of conversations (0: none can be created).
    pub fn new(capacity_bytes: usize) -> ConversationStore {
        ConversationStore {
            inner: Mutex::new(Lru::new(capacity_bytes)),
            busy: Mutex::new(HashSet::new()),
        }
    }

    /// Taken after `inner` where both are held, never the other way round.
    fn lock_busy(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.busy.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds conversation `id` for a response until what this returns is dropped; refused (400
    /// `conversation_locked`, as OpenAI's API does) while another response holds it, so that each response reads
    /// the items of the ones before it.
    pub fn begin(self: &Arc<Self>, id: &str) -> Result<Busy, ApiError> {
        if !self.lock().contains(id) {
            return Err(not_found(id).with_param("conversation"));
        }
        if !self.lock_busy().insert(id.to_string()) {
            return Err(ApiError::invalid(
                "conversation",
                format!(
                    "Another response is in progress for conversation {:?}; send this one once it has ended",
                    params::shown_id(id)
                ),
            )
            .with_code("conversation_locked"));
        }
        Ok(Busy {
            store: self.clone(),
            id: id.to_string(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lru<Conversation>> {
        // The store's state stays consistent between statements, so a panic elsewhere leaves it usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new conversation with `metadata` and up to 20 `items`.
    pub fn create(&self, metadata: Option<Json>, items: Option<Vec<Json>>) -> Result<ConversationObject, ApiError> {
        let items = checked_items(items.unwrap_or_default(), |_| false)?;
        let object = ConversationObject {
            id: params::random_id("conv_"),
            object: "conversation",
            created_at: params::unix_now(),
            metadata: checked_metadata(metadata)?,
        };
        let conversation = Conversation::new(object, items);
        let object = conversation.object.clone();
        let bytes = conversation.bytes;
        let mut inner = self.lock();
        let busy = self.lock_busy();
        if !inner.insert(object.id.clone(), conversation, bytes, |id| busy.contains(id)) {
            return Err(ApiError::bad_request(
                "no room for this conversation in the server's store (--response-store-mib)",
            ));
        }
        Ok(object)
    }

    pub fn get(&self, id: &str) -> Result<ConversationObject, ApiError> {
        let mut inner = self.lock();
        inner.get(id).map(|c| c.object.clone()).ok_or_else(|| not_found(id))
    }

    /// The conversation's items, oldest first.
    pub fn items(&self, id: &str) -> Result<Vec<Json>, ApiError> {
        let mut inner = self.lock();
        inner.get(id).map(|c| c.items.clone()).ok_or_else(|| not_found(id))
    }

    /// One page of the conversation's items (see [`responses::items_page`]); only the page is copied.
    pub fn items_page(&self, id: &str, query: &InputItemsQuery) -> Result<ItemList, ApiError> {
        let mut inner = self.lock();
        let c = inner.get(id).ok_or_else(|| not_found(id))?;
        responses::items_page(&c.items, query)
    }

    pub fn item(&self, id: &str, item_id: &str) -> Result<Json, ApiError> {
        let mut inner = self.lock();
        let c = inner.get(id).ok_or_else(|| not_found(id))?;
        let item = c.items.iter().find(|item| item["id"] == item_id);
        item.cloned().ok_or_else(|| item_not_found(id, item_id))
    }

    /// Replaces the conversation's metadata.
    pub fn update(&self, id: &str, metadata: Option<Json>) -> Result<ConversationObject, ApiError> {
        let metadata = checked_metadata(metadata)?;
        self.modify(
            id,
            |c| {
                let grows = json_bytes(&metadata) as isize - json_bytes(&c.object.metadata) as isize;
                Ok((metadata, grows))
            },
            |c, metadata| {
                c.object.metadata = metadata;
                c.object.clone()
            },
        )
    }

    pub fn delete(&self, id: &str) -> Result<Json, ApiError> {
        self.lock().remove(id).ok_or_else(|| not_found(id))?;
        Ok(json!({"id": id, "object": "conversation.deleted", "deleted": true}))
    }

    /// Adds up to 20 items a client gives (checked as a response's input is); answers them as added.
    pub fn add_items(&self, id: &str, items: Option<Vec<Json>>) -> Result<ItemList, ApiError> {
        let items = items.ok_or_else(|| ApiError::invalid("items", "`items` is required"))?;
        self.modify(
            id,
            |c| {
                let added = checked_items(items, |id| c.ids.contains(id))?;
                let grows = added.iter().map(json_bytes).sum::<usize>() as isize;
                Ok((added, grows))
            },
            |c, added| {
                c.extend(added.iter().cloned());
                list(added)
            },
        )
    }

    /// Adds a finished response's input and output items; false where the conversation is gone or full.
    pub fn append(&self, id: &str, items: Vec<Json>) -> bool {
        self.modify(
            id,
            |c| {
                let items = responses::normalized(items, |id| c.ids.contains(id));
                let grows = items.iter().map(json_bytes).sum::<usize>() as isize;
                Ok((items, grows))
            },
            |c, items| c.extend(items),
        )
        .is_ok()
    }

    /// Deletes one item; answers the conversation.
    pub fn delete_item(&self, id: &str, item_id: &str) -> Result<ConversationObject, ApiError> {
        self.modify(
            id,
            |c| {
                let at = (c.items.iter().position(|item| item["id"] == item_id))
                    .ok_or_else(|| item_not_found(id, item_id))?;
                Ok((at, -(json_bytes(&c.items[at]) as isize)))
            },
            |c, at| {
                let item = c.items.remove(at);
                if let Some(id) = item["id"].as_str() {
                    c.ids.remove(id);
                }
                c.object.clone()
            },
        )
    }

    /// Changes conversation `id` in place: `plan` checks the change against the conversation as it stands and
    /// returns what `apply` takes with the bytes the change adds (negative where it frees some); `apply` runs
    /// where the store has room for the new size. A change refused either way leaves the conversation as it was.
    fn modify<P, R>(
        &self,
        id: &str,
        plan: impl FnOnce(&Conversation) -> Result<(P, isize), ApiError>,
        apply: impl FnOnce(&mut Conversation, P) -> R,
    ) -> Result<R, ApiError> {
        let mut inner = self.lock();
        let c = inner.get(id).ok_or_else(|| not_found(id))?;
        let (change, grows) = plan(c)?;
        let bytes = c.bytes.saturating_add_signed(grows);
        let busy = self.lock_busy();
        if !inner.resize(id, bytes, |other| busy.contains(other)) {
            return Err(ApiError::bad_request(
                "no room for the changed conversation in the server's store (--response-store-mib)",
            ));
        }
        let c = inner.get(id).expect("resize keeps the conversation it grows");
        c.bytes = bytes;
        Ok(apply(c, change))
    }

    /// The conversations kept and the bytes they count for.
    pub fn usage(&self) -> (usize, usize) {
        self.lock().usage()
    }
}

fn item_id(item: &Json) -> Option<String> {
    item["id"].as_str().map(String::from)
}

fn list(data: Vec<Json>) -> ItemList {
    ItemList {
        object: "list",
        first_id: data.first().and_then(item_id),
        last_id: data.last().and_then(item_id),
        has_more: false,
        data,
    }
}

/// Items a client adds: at most 20, each one a response could take as input, kept in the API's form with an id
/// that no earlier item has (`taken` says which ids the conversation's items have).
fn checked_items(items: Vec<Json>, taken: impl Fn(&str) -> bool) -> Result<Vec<Json>, ApiError> {
    if items.len() > MAX_ADDED_ITEMS {
        return Err(ApiError::invalid(
            "items",
            format!(
                "at most {MAX_ADDED_ITEMS} items can be added at a time, got {}",
                items.len()
            ),
        ));
    }
    if !items.is_empty() {
        responses::check_input_items(&items).map_err(|mut error| {
            error.param = error.param.map(|p| p.replacen("input", "items", 1));
            error.message = error.message.replacen("input", "items", 1);
            error
        })?;
    }
    Ok(responses::normalized(items, taken))
}

/// Metadata as OpenAI takes it: up to 16 string values, keys up to 64 characters and values up to 512.
fn checked_metadata(metadata: Option<Json>) -> Result<Json, ApiError> {
    let metadata = match metadata {
        None | Some(Json::Null) => return Ok(json!({})),
        Some(Json::Object(map)) => map,
        Some(_) => return Err(ApiError::invalid("metadata", "`metadata` must be an object")),
    };
    if metadata.len() > MAX_METADATA_PAIRS {
        return Err(ApiError::invalid(
            "metadata",
            format!("`metadata` holds at most {MAX_METADATA_PAIRS} pairs"),
        ));
    }
    for (key, value) in &metadata {
        let fits = value.as_str().is_some_and(|v| v.chars().count() <= MAX_METADATA_VALUE);
        if key.chars().count() > MAX_METADATA_KEY || !fits {
            return Err(ApiError::invalid(
                "metadata",
                format!(
                    "`metadata` keys are up to {MAX_METADATA_KEY} characters and values strings of up to \
                     {MAX_METADATA_VALUE}"
                ),
            ));
        }
    }
    Ok(Json::Object(metadata))
}

pub fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!(
        "No conversation with id {:?} (never created, deleted, or dropped for room; conversations are kept in \
         memory until the server restarts)",
        params::shown_id(id)
    ))
}

fn item_not_found(id: &str, item_id: &str) -> ApiError {
    ApiError::not_found(format!(
        "Conversation {:?} has no item with id {:?}",
        params::shown_id(id),
        params::shown_id(item_id)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(text: &str) -> Json {
        json!({"role": "user", "content": text})
    }

    #[test]
    fn items_are_added_listed_and_deleted() {
        let store = Arc::new(ConversationStore::new(1 << 20));
        let c = store
            .create(Some(json!({"topic": "verona"})), Some(vec![user("hi")]))
            .unwrap();
        assert!(c.id.starts_with("conv_") && c.object == "conversation");
        assert_eq!(store.get(&c.id).unwrap().metadata, json!({"topic": "verona"}));
        let added = store.add_items(&c.id, Some(vec![user("more"), user("again")])).unwrap();
        assert_eq!(added.data.len(), 2);
        let items = store.items(&c.id).unwrap();
        assert_eq!(items.len(), 3);
        assert_eq!(items[0]["content"], json!([{"type": "input_text", "text": "hi"}]));
        assert_eq!(items[1]["id"], added.data[0]["id"]);
        let second = items[1]["id"].as_str().unwrap().to_string();
        assert_eq!(store.item(&c.id, &second).unwrap()["content"][0]["text"], "more");
        store.delete_item(&c.id, &second).unwrap();
        assert_eq!(store.items(&c.id).unwrap().len(), 2);
        assert_eq!(store.item(&c.id, &second).unwrap_err().status.as_u16(), 404);
        assert!(store.append(
            &c.id,
            vec![json!({"type": "message", "role": "assistant", "content": "ok"})]
        ));
        assert_eq!(store.items(&c.id).unwrap().len(), 3);
        let updated = store.update(&c.id, Some(json!({"topic": "mantua"}))).unwrap();
        assert_eq!(updated.metadata["topic"], "mantua");
        assert_eq!(store.delete(&c.id).unwrap()["deleted"], true);
        assert_eq!(store.get(&c.id).unwrap_err().status.as_u16(), 404);
        assert!(!store.append(&c.id, vec![user("late")]));
    }

    #[test]
    fn a_conversation_takes_one_response_at_a_time_and_is_not_dropped_meanwhile() {
        // Room for about three small conversations.
        let store = Arc::new(ConversationStore::new(3000));
        let c = store.create(None, Some(vec![user("hi")])).unwrap();
        let busy = store.begin(&c.id).unwrap();
        let error = store.begin(&c.id).err().unwrap();
        assert_eq!((error.status.as_u16(), error.code), (400, Some("conversation_locked")));
        // Other conversations push each other out, never the busy one.
        for _ in 0..5 {
            store.create(None, Some(vec![user("more")])).unwrap();
        }
        assert!(store.get(&c.id).is_ok());
        drop(busy);
        assert!(store.begin(&c.id).is_ok());
        assert_eq!(store.begin("conv_none").err().unwrap().status.as_u16(), 404);
    }

    #[test]
    fn bad_items_metadata_and_oversized_conversations_are_refused() {
        let store = Arc::new(ConversationStore::new(1 << 20));
        let too_many = (0..21).map(|i| user(&i.to_string())).collect();
        for (metadata, items, param) in [
            (None, Some(too_many), "items"),
            (None, Some(vec![json!({"type": "input_image"})]), "items[0].type"),
            (Some(json!("x")), None, "metadata"),
            (Some(json!({"k": 1})), None, "metadata"),
            (Some(json!({"k": "v".repeat(513)})), None, "metadata"),
        ] {
            let error = store.create(metadata, items).unwrap_err();
            assert_eq!(error.param.as_deref(), Some(param), "{}", error.message);
        }
        // A conversation never grows past the store: the change is refused and it stays as it was.
        let small = ConversationStore::new(1500);
        let c = small.create(None, Some(vec![user("hi")])).unwrap();
        let error = small.add_items(&c.id, Some(vec![user(&"x".repeat(1000))])).unwrap_err();
        assert_eq!(error.status.as_u16(), 400);
        assert_eq!(small.items(&c.id).unwrap().len(), 1);
    }

    /// What the store counts conversation `id` for, and what measuring it again from scratch gives.
    fn counted_and_measured(store: &ConversationStore, id: &str) -> (usize, usize) {
        let mut inner = store.lock();
        let c = inner.get(id).unwrap();
        let counted = c.bytes;
        let again = Conversation::new(c.object.clone(), c.items.clone());
        assert_eq!(c.ids, again.ids, "the kept ids are the items' ids");
        (counted, again.bytes)
    }

    #[test]
    fn an_item_keeps_its_id_unless_an_item_of_the_conversation_has_it() {
        let store = Arc::new(ConversationStore::new(1 << 20));
        let named = |text: &str| json!({"type": "message", "role": "user", "content": text, "id": "msg_mine"});
        let c = store.create(None, Some(vec![named("first")])).unwrap();
        let ids = |store: &ConversationStore| -> Vec<String> {
            let items = store.items(&c.id).unwrap();
            items
                .iter()
                .map(|item| item["id"].as_str().unwrap().to_string())
                .collect()
        };
        assert_eq!(ids(&store), ["msg_mine"]);
        // Taken by the conversation, and twice in one request: both get new ids.
        store
            .add_items(&c.id, Some(vec![named("second"), named("third")]))
            .unwrap();
        assert!(store.append(&c.id, vec![named("fourth")]));
        let now = ids(&store);
        assert_eq!(now.len(), 4);
        assert_eq!(now.iter().collect::<HashSet<_>>().len(), 4, "{now:?}");
        // Once its item is deleted, the id is free again.
        store.delete_item(&c.id, "msg_mine").unwrap();
        assert!(!ids(&store).contains(&"msg_mine".to_string()));
        store.add_items(&c.id, Some(vec![named("fifth")])).unwrap();
        assert_eq!(ids(&store).last().unwrap(), "msg_mine");
        let (counted, measured) = counted_and_measured(&store, &c.id);
        assert_eq!(counted, measured);
    }

    #[test]
    fn changes_in_place_count_what_a_fresh_measure_counts() {
        let store = Arc::new(ConversationStore::new(1 << 20));
        let c = store.create(Some(json!({"a": "1"})), Some(vec![user("hi")])).unwrap();
        let (counted, measured) = counted_and_measured(&store, &c.id);
        assert_eq!(counted, measured);
        let added = store.add_items(&c.id, Some(vec![user("one"), user("two")])).unwrap();
        assert!(store.append(
            &c.id,
            vec![json!({"type": "message", "role": "assistant", "content": "three"})]
        ));
        store
            .update(&c.id, Some(json!({"a": "a longer value", "b": "2"})))
            .unwrap();
        let first_added = added.data[0]["id"].as_str().unwrap();
        store.delete_item(&c.id, first_added).unwrap();
        let (after, measured) = counted_and_measured(&store, &c.id);
        assert_eq!(after, measured);
        assert!(after > counted);
        // The store's total follows: one conversation, counted with its id.
        assert_eq!(store.usage(), (1, crate::lru::entry_bytes(&c.id, after)));
        // A refused change (no such item) leaves it, and its count, as they were.
        assert_eq!(store.delete_item(&c.id, "msg_none").unwrap_err().status.as_u16(), 404);
        assert_eq!(counted_and_measured(&store, &c.id), (after, after));
        assert_eq!(store.items(&c.id).unwrap().len(), 3);
    }

    #[test]
    fn a_page_of_items_is_listed_from_the_store() {
        let store = Arc::new(ConversationStore::new(1 << 20));
        let c = store
            .create(None, Some((0..5).map(|i| user(&i.to_string())).collect()))
            .unwrap();
        let query = |q: Json| serde_json::from_value::<InputItemsQuery>(q).unwrap();
        let texts = |page: &ItemList| -> Vec<String> {
            (page.data.iter())
                .map(|i| i["content"][0]["text"].as_str().unwrap().to_string())
                .collect()
        };
        let page = store.items_page(&c.id, &query(json!({"limit": 2}))).unwrap();
        assert_eq!(
            (texts(&page), page.has_more),
            (vec!["4".to_string(), "3".to_string()], true)
        );
        let after = page.last_id.clone().unwrap();
        let next = store
            .items_page(&c.id, &query(json!({"limit": 2, "after": after})))
            .unwrap();
        assert_eq!(texts(&next), vec!["2".to_string(), "1".to_string()]);
        let error = store
            .items_page(&c.id, &query(json!({"after": "msg_none"})))
            .unwrap_err();
        assert_eq!(error.param.as_deref(), Some("after"));
        assert_eq!(
            store
                .items_page("conv_none", &query(json!({})))
                .unwrap_err()
                .status
                .as_u16(),
            404
        );
    }
}

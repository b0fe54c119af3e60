//! The `TF_CONFIG` environment variable: parse and emit.
//!
//! Format (TensorFlow's): `{"cluster": {...}, "task": {"type": "worker", "index": 1},
//! "rpc_layer": "grpc", "environment": "cloud"}`. mpiflow requires `task` (a process must know
//! its own role), accepts only the four known job types, and checks TensorFlow's rules: at
//! most one chief and one evaluator, the task exists in the cluster (an evaluator need not,
//! as it is not part of the training cluster), no address used twice.

use serde_json::{Map, Value};

use super::spec::{ClusterSpec, Role, SpecError, TaskId};

/// Errors from parsing `TF_CONFIG`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TfConfigError {
    #[error("TF_CONFIG is not set, and the cluster is to come from it")]
    NotSet,
    #[error("TF_CONFIG is not valid JSON: {0}")]
    NotJson(String),
    #[error("TF_CONFIG must be a JSON object")]
    NotObject,
    #[error("TF_CONFIG has no \"cluster\"")]
    NoCluster,
    #[error("TF_CONFIG has no \"task\" (expected {{\"type\": ..., \"index\": ...}})")]
    NoTask,
    #[error("TF_CONFIG \"task\": {0}")]
    BadTask(String),
    #[error("TF_CONFIG \"{field}\" must be a string")]
    NotString { field: String },
    #[error("TF_CONFIG: {0}")]
    Spec(#[from] SpecError),
}

/// A parsed `TF_CONFIG`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TfConfig {
    pub cluster: ClusterSpec,
    pub task: TaskId,
    pub rpc_layer: Option<String>,
    pub environment: Option<String>,
}

impl TfConfig {
    pub fn new(cluster: ClusterSpec, task: TaskId) -> Self {
        TfConfig {
            cluster,
            task,
            rpc_layer: None,
            environment: None,
        }
    }

    /// Parses and validates a `TF_CONFIG` string.
    pub fn parse(text: &str) -> Result<TfConfig, TfConfigError> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| TfConfigError::NotJson(e.to_string()))?;
        let obj = v.as_object().ok_or(TfConfigError::NotObject)?;
        let cluster = ClusterSpec::from_json(obj.get("cluster").ok_or(TfConfigError::NoCluster)?)?;
        cluster.validate_roles()?;
        let task = obj.get("task").ok_or(TfConfigError::NoTask)?;
        let task = parse_task(task)?;
        let role = task.role()?;
        if role != Role::Evaluator || cluster.has_job("evaluator") {
            cluster.task_address(&task.job, task.index)?;
        }
        let string_field = |field: &str| -> Result<Option<String>, TfConfigError> {
            match obj.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(TfConfigError::NotString {
                    field: field.into(),
                }),
            }
        };
        Ok(TfConfig {
            rpc_layer: string_field("rpc_layer")?,
            environment: string_field("environment")?,
            cluster,
            task,
        })
    }

    /// The one-line JSON form, keys in TensorFlow's order, jobs sorted.
    pub fn to_json(&self) -> String {
        let mut task = Map::new();
        task.insert("type".into(), self.task.job.clone().into());
        task.insert("index".into(), self.task.index.into());
        let mut out = Map::new();
        out.insert("cluster".into(), self.cluster.as_dict());
        out.insert("task".into(), Value::Object(task));
        if let Some(r) = &self.rpc_layer {
            out.insert("rpc_layer".into(), r.clone().into());
        }
        if let Some(e) = &self.environment {
            out.insert("environment".into(), e.clone().into());
        }
        Value::Object(out).to_string()
    }
}

fn parse_task(task: &Value) -> Result<TaskId, TfConfigError> {
    let bad = |s: &str| TfConfigError::BadTask(s.to_string());
    let t = task.as_object().ok_or_else(|| bad("must be an object"))?;
    let job = t
        .get("type")
        .ok_or_else(|| bad("has no \"type\""))?
        .as_str()
        .ok_or_else(|| bad("\"type\" must be a string"))?;
    let index = match t.get("index") {
        None => return Err(bad("has no \"index\"")),
        Some(Value::Number(n)) => n
            .as_u64()
            .ok_or_else(|| bad(&format!("\"index\" {n} is not a non-negative integer")))?,
        // TensorFlow's resolver accepts the index as a string too.
        Some(Value::String(s)) => s
            .parse()
            .map_err(|_| bad(&format!("\"index\" {s:?} is not a non-negative integer")))?,
        Some(other) => return Err(bad(&format!("\"index\" {other} is not an integer"))),
    };
    Ok(TaskId::new(job, index as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"], "ps": ["h3:2222"]},
        "task": {"type": "worker", "index": 1}, "rpc_layer": "grpc", "environment": "cloud"}"#;

    #[test]
    fn parse_and_emit_round_trip() {
        let c = TfConfig::parse(GOOD).unwrap();
        assert_eq!(c.task, TaskId::new("worker", 1));
        assert_eq!(c.rpc_layer.as_deref(), Some("grpc"));
        assert_eq!(c.environment.as_deref(), Some("cloud"));
        let out = c.to_json();
        assert_eq!(
            out,
            r#"{"cluster":{"chief":["h0:2222"],"ps":["h3:2222"],"worker":["h1:2222","h2:2222"]},"task":{"type":"worker","index":1},"rpc_layer":"grpc","environment":"cloud"}"#
        );
        assert_eq!(TfConfig::parse(&out).unwrap(), c);
    }

    #[test]
    fn evaluator_need_not_be_in_cluster() {
        let c = TfConfig::parse(
            r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "evaluator", "index": 0}}"#,
        )
        .unwrap();
        assert_eq!(c.task.job, "evaluator");
    }

    #[test]
    fn bad_tf_configs() {
        for (text, want) in [
            ("not json", "not valid JSON"),
            ("[1]", "must be a JSON object"),
            (
                r#"{"task": {"type": "worker", "index": 0}}"#,
                "no \"cluster\"",
            ),
            (r#"{"cluster": {"worker": ["a:1"]}}"#, "no \"task\""),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}}"#,
                "no \"index\"",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}}"#,
                "not a non-negative integer",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1}}"#,
                "task worker:1 is not in the cluster",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "master", "index": 0}}"#,
                "unknown job type \"master\"",
            ),
            (
                r#"{"cluster": {"boss": ["a:1"]}, "task": {"type": "worker", "index": 0}}"#,
                "unknown job type \"boss\"",
            ),
            (
                r#"{"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}}"#,
                "at most one chief",
            ),
            (
                r#"{"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}}"#,
                "duplicate address a:1",
            ),
            (
                r#"{"cluster": {"worker": ["a:99999"]}, "task": {"type": "worker", "index": 0}}"#,
                "out of range",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}, "rpc_layer": 5}"#,
                "\"rpc_layer\" must be a string",
            ),
        ] {
            let e = TfConfig::parse(text).unwrap_err().to_string();
            assert!(e.contains(want), "{text}: got {e:?}, want {want:?}");
            assert!(!e.contains('\n'), "one line: {e}");
        }
    }
}
